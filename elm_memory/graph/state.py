"""Graph state. Plain JSON-able values only (no tensors), so any checkpointer can save it
and a parent graph can share the ``question``/``answer`` keys.

``warnings`` and ``timings`` have reducers: a node returns only what it adds, and the
first node of a run returns a :class:`Fresh` value so that a checkpointed thread that
answers several questions keeps the trace of the latest one only.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict


class Fresh(list):  # noqa: FURB189 (a marker type: behaves as the list it wraps)
    """A warnings update that replaces the channel instead of extending it (start of a run)."""


class FreshTimings(dict):  # noqa: FURB189
    """A timings update that replaces the channel instead of merging into it (start of a run)."""


def add_warnings(current: list[str] | None, update: list[str] | None) -> list[str]:
    if isinstance(update, Fresh):
        return list(update)
    return [*(current or []), *(update or [])]


def merge_timings(current: dict[str, float] | None, update: dict[str, float] | None) -> dict[str, float]:
    if isinstance(update, FreshTimings):
        return dict(update)
    return {**(current or {}), **(update or {})}


class CandidateState(TypedDict, total=False):
    kind: str  # "zero_shot" | "memory"
    answer: str | None
    response: str
    token_ids: list[int]
    finish_reason: str
    score: float | None


class GateState(TypedDict, total=False):
    """Why the retrieved memory was or was not used (see ``Retriever.retrieve_with_gates``)."""

    decision: str  # "used" | "empty_pool" | "below_min_similarity" | "weak_majority" | "no_consensus" | ...
    candidate_id: str | None
    similarity: float | None
    majority_share: float | None
    threshold: float | None
    skipped: int


class ELMInput(TypedDict, total=False):
    question: str
    namespace: str  # default: the run context's namespace, its template, or the config's namespace
    learn: bool  # submit the question to the memory learner after answering (default True)


class ELMOutput(TypedDict, total=False):
    namespace: str  # the namespace the run used
    answer: str | None
    response: str
    route: str  # "zero_shot" | "agree" | "answered" | "verifier" | "vote" | "stream" (the stream memory alone)
    memory_id: str | None
    similarity: float | None
    gate: GateState | None
    candidates: list[CandidateState]
    timings: Annotated[dict[str, float], merge_timings]
    warnings: Annotated[list[str], add_warnings]
    learn_job: dict[str, Any] | None
    # the answers of the samples a sampling verifier (consistency) scored this disagreement on,
    # a tie's extra draw included; absent when no sampling verifier scored
    verifier_sample_answers: list[str | None]
    # stream.mode stream/both: what the stream memory's update did (version used and written, label, skip)
    stream_update: dict[str, Any] | None
    # stream.mode stream/both: how the answer was made (mode, gate state, probe, version, tokens generated)
    stream_turn: dict[str, Any] | None


class ELMState(ELMInput, ELMOutput, total=False):
    """Input and output keys together: what flows between the nodes."""

    # answers of a sampling verifier's samples, drawn with the candidates (`consistency_presample`);
    # None when none were drawn ahead
    presampled_answers: list[str | None] | None
    # their texts, kept only for ``verifier.route=vote`` (a sample's text answers when its answer wins)
    presampled_responses: list[str] | None
    # stream.mode stream/both: the stream memory's version that answered and its samples' tokens (for learning)
    stream: dict[str, Any] | None
