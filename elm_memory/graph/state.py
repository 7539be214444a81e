"""Graph state. Plain JSON-able values only (no tensors), so any checkpointer can save it
and a parent graph can share the ``question``/``answer`` keys."""

from __future__ import annotations

from typing import Any, TypedDict


class CandidateState(TypedDict, total=False):
    kind: str  # "zero_shot" | "memory"
    answer: str | None
    response: str
    token_ids: list[int]
    finish_reason: str
    score: float | None


class ELMInput(TypedDict, total=False):
    question: str
    namespace: str  # default: the config's namespace
    learn: bool  # submit the question to the memory learner after answering (default True)


class ELMOutput(TypedDict, total=False):
    answer: str | None
    response: str
    route: str  # "zero_shot" | "agree" | "verifier"
    memory_id: str | None
    similarity: float | None
    candidates: list[CandidateState]
    timings: dict[str, float]
    warnings: list[str]
    learn_job: dict[str, Any] | None


class ELMState(ELMInput, ELMOutput, total=False):
    """Input and output keys together: what flows between the nodes."""
