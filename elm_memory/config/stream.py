"""``stream``: the stream memory, one latent memory per namespace that every answered question trains.

Per-question memories (the paper's) are learned from one question and retrieved for later ones; a stream
memory is trained a little by each question, from the answer path's own generations (its greedy answer and
the verifier's samples, drawn with the current version; or zero-shot's, ``learn_from``), so experience
accumulates in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from elm_memory.config.section import ConfigSection

#: The one-sentence format instruction: the ``zero_shot_format`` baseline appends it to the question, and a
#: stream memory's ``instruction`` init starts from its token embeddings (so the untrained memory is this
#: sentence as a soft prompt).
FORMAT_INSTRUCTION = "Be concise: show only the key steps, then end with the final answer in \\boxed{}."


class StreamConfig(ConfigSection):
    """A stream memory: what trains it, how fast, and when an update is rolled back."""

    mode: Literal["per_question", "stream", "both"] = Field(
        default="per_question",
        description=(
            "`per_question`: the paper's memories only. `stream`: one stream memory per namespace answers and "
            "learns from every question. `both`: the stream memory's candidate beside the retrieved memory's."
        ),
    )
    objective: Literal["grpo", "sft"] = Field(
        default="grpo",
        description=(
            "`grpo`: Dr.GRPO on the samples, reward 1 where a sample's answer equals the vote. `sft`: "
            "self-distillation, the log-likelihood of the generations that agree with the vote. Unset, it is "
            "`sft` with `learn_from: zero_shot` (and so with `serving: amortized`), else `grpo`."
        ),
    )
    learn_from: Literal["own", "zero_shot"] = Field(
        default="own",
        description=(
            "`own`: the stream memory's greedy answer and samples, labelled by their vote (on-policy; the label "
            "moves with the memory). `zero_shot`: zero-shot's greedy answer and the samples drawn without the "
            "memory, labelled by their vote (self-consistency's): the label cannot drift with the memory, which "
            "learns to give the vote's answer first. Needs objective `sft`. Unset, it is `zero_shot` with "
            "`serving: amortized`, else `own`."
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
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient clipping per update.")
    init: Literal["instruction", "random"] = Field(
        default="instruction",
        description="`instruction`: the token embeddings of `format_instruction`, tiled to `memory.num_tokens`.",
    )
    format_instruction: str = Field(
        default=FORMAT_INSTRUCTION,
        min_length=1,
        description="The sentence the `zero_shot_format` baseline appends to the question (and the init's text).",
    )
    min_label_share: float = Field(
        default=0.4,
        ge=0.0,
        le=1.0,
        description="Skip the update when fewer of the rows it learns from agree with their vote (0.4: 2 of 5).",
    )
    guard_window: int = Field(
        default=8, ge=2, description="Questions the collapse guard looks back over (answered since the last check)."
    )
    guard_max_unboxed_increase: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Roll back when the memory's answers lack a \\boxed{} this much more often than zero-shot's.",
    )
    guard_max_agreement_drop: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="Roll back when the samples' mean majority share falls this far below the first window's.",
    )
    guard_max_agreement_rise: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description=(
            "Roll back when the samples' mean majority share rises this far above the first window's (samples "
            "collapsing onto one another; real learning raises it too, so off unless set)."
        ),
    )
    guard_max_repeated_answer: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Roll back when one answer wins the vote on more than this share of the window's questions.",
    )
    update_every: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Questions pooled into one update: their generations are kept (in this process) until this many "
            "usable ones have come, then one optimizer step over all of them, one new version."
        ),
    )
    clusters: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Stream memories per namespace, one per cluster of the questions' retrieval keys, found online (1: "
            "one for the namespace). Needs a store (the retriever builds the keys)."
        ),
    )
    cluster_min_similarity: float = Field(
        default=0.8,
        ge=-1.0,
        le=1.0,
        description=(
            "A question whose key is less similar (cosine) than this to every cluster opens a new one, while "
            "fewer than `clusters` exist; otherwise it joins the most similar."
        ),
    )
    replay: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "Earlier questions each update learns from again, drawn from the kept ones (their agreeing rows and "
            "label, stored: no new decode). 0: none. Needs objective `sft`, unless `replay_samples` is 2 or more."
        ),
    )
    replay_samples: int = Field(
        default=0,
        ge=0,
        le=32,
        description=(
            "Re-sample each replayed question: this many fresh samples under the version being trained (the "
            "answer path's samples' temperature and budget), scored against its kept label, instead of its "
            "stored rows. A decode per update, counted in the update's time. 0: the stored rows."
        ),
    )
    replay_buffer: int = Field(
        default=32,
        ge=1,
        le=256,
        description=(
            "Questions kept for replay, the newest (in each version's file: rollbacks and resumes see them); "
            "with `replay_samples` they are kept without their rows, so more fit the file's byte budget."
        ),
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
            "it. Learns from zero-shot's samples (`learn_from: zero_shot`, objective `sft`)."
        ),
    )
    probe_share: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description="`amortized`, gate open: the share of questions that also draw zero-shot's answer and the samples.",
    )
    gate_test: Literal["superiority", "non_inferiority", "sample_share"] = Field(
        default="superiority",
        description=(
            "`amortized`: what opens the gate. `superiority`: the memory's greedy answer agrees with the samples' "
            "vote more often than zero-shot's, by `gate_margin` of the questions where only one of them agrees. "
            "`non_inferiority`: it agrees at least as often, less `gate_tolerance` (every question with a clear "
            "vote counts, ties too); it closes when the memory falls behind. `sample_share`: the same test on every "
            "question, reading the share of the samples that gave the memory's answer less the share that gave "
            "zero-shot's. docs/stream-memory.md#amortized-serving."
        ),
    )
    gate_margin: float = Field(
        default=0.75,
        gt=0.5,
        lt=1.0,
        description=(
            "`amortized`, `gate_test: superiority`: the share of the questions where exactly one of the memory and "
            "zero-shot agrees with the samples' vote that the memory must win for the gate to open (and zero-shot "
            "to close it)."
        ),
    )
    gate_tolerance: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description=(
            "`amortized`, `gate_test: non_inferiority` or `sample_share`: how far below zero-shot's rate of agreeing "
            "with the vote (or share of the samples) the memory's may be for the gate to open (0.05: one question in "
            "twenty)."
        ),
    )
    gate_alpha: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="`amortized`: the gate opens (or closes) when its sequential test's statistic reaches 1/alpha.",
    )
    gate_min_questions: int = Field(
        default=16,
        ge=1,
        description="`amortized`: probed questions read before the gate may open (after it closes, again).",
    )

    @model_validator(mode="before")
    @classmethod
    def _learning_follows_serving(cls, data: Any) -> Any:
        """``learn_from`` and ``objective`` left unset follow what is set: amortized serving draws no samples under
        the memory, so it learns from zero-shot's, and samples the memory did not draw train only by ``sft``."""
        if isinstance(data, dict):
            if data.get("serving") == "amortized":
                data = {"learn_from": "zero_shot", **data}
            if data.get("learn_from") == "zero_shot":
                data = {"objective": "sft", **data}
        return data

    @model_validator(mode="after")
    def _off_policy_needs_sft(self) -> StreamConfig:
        if self.serving == "amortized" and self.mode == "both":
            raise ValueError(
                "stream.serving=amortized answers with the stream memory alone; stream.mode=both adds the retrieved "
                "memory's vote: set stream.mode=stream (or stream.serving=vote)"
            )
        if self.serving == "amortized" and self.learn_from != "zero_shot":
            raise ValueError(
                "stream.serving=amortized learns from the vote of zero-shot's samples (the memory's greedy answer "
                "answers alone once the gate opens, so it draws no samples of its own): set "
                "stream.learn_from=zero_shot and stream.objective=sft"
            )
        # the policy gradient assumes the samples were drawn by the memory being trained
        if self.learn_from == "zero_shot" and self.objective != "sft":
            raise ValueError(
                f"stream.learn_from=zero_shot trains on samples the memory did not draw; stream.objective="
                f"{self.objective} needs its own samples: set stream.objective=sft (or stream.learn_from=own)"
            )
        if self.replay_samples and not self.replay:
            raise ValueError(
                f"stream.replay_samples={self.replay_samples} re-samples replayed questions, but stream.replay=0 "
                "replays none: set stream.replay (or stream.replay_samples=0)"
            )
        if self.replay and self.objective != "sft" and self.replay_samples < 2:
            raise ValueError(
                f"stream.replay={self.replay} with stream.replay_samples={self.replay_samples}: "
                f"stream.objective={self.objective} needs at least 2 fresh samples of each replayed question under "
                "the trained version (stored rows are another version's; one sample has no advantage): set "
                "stream.replay_samples=2 or more, or stream.objective=sft, or stream.replay=0"
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
