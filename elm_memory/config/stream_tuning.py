"""``stream.tuning``: the stream memory's settings that the project's evaluations chose and vary.

A user sets a stream memory with the handful of settings in :class:`~elm_memory.config.stream.StreamConfig`; these
are the objective, the label's threshold, the collapse guard's thresholds, the gate's test, pooling, clusters and
replay. Their defaults are what the evidence chose (docs/stream-memory.md), and the evaluation arms
(:mod:`elm_memory.eval.methods.stream_method`) vary them. They stay in the config, not in the evaluation alone,
because the graph runs them: what an evaluation measures is what a user's graph executes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from elm_memory.config.section import ConfigSection

#: The one-sentence format instruction: the ``zero_shot_format`` baseline appends it to the question, and a
#: stream memory's ``instruction`` init starts from its token embeddings (so the untrained memory is this
#: sentence as a soft prompt).
FORMAT_INSTRUCTION = "Be concise: show only the key steps, then end with the final answer in \\boxed{}."


class StreamTuning(ConfigSection):
    """What trains a stream memory and when an update is kept, rolled back or served: set by evaluations."""

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
    gate_read_share: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description=(
            "`amortized`, gate closed (warm-up, probation): the share of questions, picked by a hash of the question, "
            "that also draw the memory's greedy answer for the gate and the collapse guard; the vote alone answers "
            "and teaches on the rest. That row is one decode in k + 2: a share below 1 cuts its cost and the "
            "gate's readings alike."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _objective_follows_source(cls, data: Any) -> Any:
        """``objective`` left unset follows ``learn_from``: samples the memory did not draw train only by ``sft``."""
        if isinstance(data, dict) and data.get("learn_from") == "zero_shot":
            data = {"objective": "sft", **data}
        return data

    @model_validator(mode="after")
    def _trainable(self) -> StreamTuning:
        # the policy gradient assumes the samples were drawn by the memory being trained
        if self.learn_from == "zero_shot" and self.objective != "sft":
            raise ValueError(
                f"stream.tuning.learn_from=zero_shot trains on samples the memory did not draw; "
                f"stream.tuning.objective={self.objective} needs its own samples: set stream.tuning.objective=sft "
                "(or stream.tuning.learn_from=own)"
            )
        if self.replay_samples and not self.replay:
            raise ValueError(
                f"stream.tuning.replay_samples={self.replay_samples} re-samples replayed questions, but "
                "stream.tuning.replay=0 replays none: set stream.tuning.replay (or stream.tuning.replay_samples=0)"
            )
        if self.replay and self.objective != "sft" and self.replay_samples < 2:
            raise ValueError(
                f"stream.tuning.replay={self.replay} with stream.tuning.replay_samples={self.replay_samples}: "
                f"stream.tuning.objective={self.objective} needs at least 2 fresh samples of each replayed question "
                "under the trained version (stored rows are another version's; one sample has no advantage): set "
                "stream.tuning.replay_samples=2 or more, or stream.tuning.objective=sft, or stream.tuning.replay=0"
            )
        return self


#: The settings that moved from ``stream.*`` into ``stream.tuning.*``: a flat key still loads, with a warning
#: (those added since never had a flat spelling).
TUNING_KEYS = tuple(k for k in StreamTuning.model_fields if k != "gate_read_share")
