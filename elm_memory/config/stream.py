"""``stream``: the stream memory, one latent memory per namespace that every answered question trains.

Per-question memories (the paper's) are learned from one question and retrieved for later ones; a stream
memory is trained a little by each question, from the answer path's own generations (its greedy answer and
the verifier's samples, drawn with the current version; or zero-shot's), so experience accumulates in one place.
A user sets the handful of settings here; what the evaluations chose and vary is ``stream.tuning``
(:mod:`elm_memory.config.stream_tuning`).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from elm_memory.config.section import ConfigSection
from elm_memory.config.stream_tuning import FORMAT_INSTRUCTION, TUNING_KEYS, StreamTuning

__all__ = ["FORMAT_INSTRUCTION", "StreamConfig", "StreamTuning", "current_spelling", "moved_into_tuning"]


class StreamConfig(ConfigSection):
    """A stream memory: whether there is one, what it is, how it serves, how fast it learns, what it keeps."""

    #: keys that moved into ``tuning``: they still load, with a DeprecationWarning (:meth:`_settle`)
    MOVED_KEYS: ClassVar[tuple[str, ...]] = TUNING_KEYS

    mode: Literal["per_question", "stream", "both"] = Field(
        default="per_question",
        description=(
            "`per_question`: the paper's memories only. `stream`: one stream memory per namespace answers and "
            "learns from every question. `both`: the stream memory's candidate beside the retrieved memory's."
        ),
    )
    kind: Literal["soft_prompt", "lora"] = Field(
        default="soft_prompt",
        description=(
            "`soft_prompt`: `memory.num_tokens` vectors before the question, started from `init`. `lora`: "
            "rank `memory.lora_rank` on every attention and MLP projection, B = 0 at the start, so the untrained "
            "stream memory is the base model exactly (its greedy answer is zero-shot's)."
        ),
    )
    learning_rate: float | None = Field(
        default=None,
        gt=0.0,
        description="AdamW learning rate of the stream memory (default: 3e-4 for a soft prompt, 1e-4 for lora).",
    )
    keep_versions: int = Field(
        default=4,
        ge=0,
        description=(
            "Versions kept on disk, the newest first (0: every one; at least 2), besides the ones a rollback may "
            "return to (the gate's approved version, the guard window's first). Disk per namespace: "
            "docs/stream-memory.md."
        ),
    )
    serving: Literal["vote", "amortized"] = Field(
        default="vote",
        description=(
            "`vote`: every question draws the samples and answers by their vote with the memory's greedy answer. "
            "`amortized`: the answer path votes (greedy + samples, without the memory) until the gate finds the "
            "memory's greedy answer agreeing with the vote more often than zero-shot's; then the memory's greedy "
            "answer alone answers, and a share `probe_share` of questions still draws the vote to teach and check "
            "it. Learns from zero-shot's samples (`tuning.learn_from: zero_shot`, `tuning.objective: sft`)."
        ),
    )
    probe_share: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description="`amortized`, gate open: the share of questions that also draw zero-shot's answer and the samples.",
    )
    tuning: StreamTuning = Field(
        default_factory=StreamTuning,
        description=(
            "What the evaluations chose and vary: the objective and what it learns from (unset, they follow "
            "`serving`), the label threshold, the collapse guard, the gate's test, pooling, clusters and replay. "
            "docs/stream-memory.md."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _settle(cls, data: Any) -> Any:
        """A key that moved into ``tuning`` still loads (with a DeprecationWarning naming its new place); ``learn_from``
        left unset follows ``serving``: amortized serving draws no samples under the memory, so it learns from
        zero-shot's (and ``objective`` then follows ``learn_from``)."""
        if not isinstance(data, dict):
            return data
        data = current_spelling(data, "stream")
        if data.get("serving") == "amortized":
            given = data.get("tuning", {})
            tuning = _as_set(given)
            if isinstance(tuning, dict):
                settled = {"learn_from": "zero_shot", **tuning}
                # an assignment (``cfg.stream.serving = ...``) validates no other field: keep tuning a model
                data = {**data, "tuning": StreamTuning(**settled) if isinstance(given, StreamTuning) else settled}
        return data

    @model_validator(mode="after")
    def _servable(self) -> StreamConfig:
        if self.serving == "amortized" and self.mode == "both":
            raise ValueError(
                "stream.serving=amortized answers with the stream memory alone; stream.mode=both adds the retrieved "
                "memory's vote: set stream.mode=stream (or stream.serving=vote)"
            )
        if self.serving == "amortized" and self.tuning.learn_from != "zero_shot":
            raise ValueError(
                "stream.serving=amortized learns from the vote of zero-shot's samples (the memory's greedy answer "
                "answers alone once the gate opens, so it draws no samples of its own): set "
                "stream.tuning.learn_from=zero_shot and stream.tuning.objective=sft"
            )
        return self

    @property
    def lr(self) -> float:
        """``learning_rate``, or the kind's default: 3e-4 for a soft prompt, the paper's LoRA rate 1e-4 for lora."""
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-4 if self.kind == "lora" else 3e-4

    @property
    def versions_to_keep(self) -> int:
        """``keep_versions``, at least 2 (0: keep every version): the newest two keep their optimizer moments, and a
        resumed evaluation may return to the one before the newest. The versions a rollback returns to are pinned
        apart (:meth:`~elm_memory.training.stream.StreamMemory.pinned_versions`)."""
        return max(self.keep_versions, 2) if self.keep_versions else 0


def current_spelling(stream: dict[str, Any], where: str) -> dict[str, Any]:
    """:func:`moved_into_tuning`, with a DeprecationWarning that names ``where`` the old keys were and their new
    spelling."""
    flat = [k for k in stream if k in TUNING_KEYS]
    if flat:
        warnings.warn(
            f"{where}: stream settings moved into stream.tuning; spell them "
            + ", ".join(f"stream.tuning.{k}" for k in flat)
            + " (the old spelling goes in the next release)",
            DeprecationWarning,
            stacklevel=3,
        )
    return moved_into_tuning(stream)


def moved_into_tuning(stream: dict[str, Any]) -> dict[str, Any]:
    """A ``stream`` section's mapping with the keys that moved spelled inside ``tuning`` (where both spellings are
    given, the new one wins): what loading does to an old config, and what a resumed run does to its manifest."""
    flat = {k: v for k, v in stream.items() if k in TUNING_KEYS}
    if not flat:
        return stream
    return {
        **{k: v for k, v in stream.items() if k not in flat},
        "tuning": {**flat, **_as_set(stream.get("tuning", {}))},
    }


def _as_set(tuning: Any) -> Any:
    """A ``tuning`` given as a :class:`StreamTuning` as the mapping of what was set in it (so derived defaults still
    apply); anything else as it is."""
    return tuning.model_dump(exclude_unset=True) if isinstance(tuning, StreamTuning) else tuning
