"""The route rule on two candidate answers, as a pure function: the graph's ``route`` node uses it, and
an evaluation replays it on recorded answers (:mod:`elm_memory.eval.paired`), so the two cannot drift."""

from __future__ import annotations

from collections.abc import Sequence

from elm_memory.answers import equivalent

__all__ = ["AGREE", "ANSWERED", "VERIFIER", "ZERO_SHOT", "memory_wins", "route_of"]

ZERO_SHOT, AGREE, ANSWERED, VERIFIER = "zero_shot", "agree", "answered", "verifier"


def route_of(zero_shot: str | None, memory: str | None, *, has_memory: bool, prefer_answered: bool) -> str:
    """Which rule decides: no memory candidate (zero-shot), equivalent answers (agree), exactly one
    answered when ``prefer_answered`` (answered), otherwise the verifier."""
    if not has_memory:
        return ZERO_SHOT
    if equivalent(zero_shot, memory):
        return AGREE
    if prefer_answered and (zero_shot is None) != (memory is None):
        return ANSWERED
    return VERIFIER


def memory_wins(scores: Sequence[float]) -> bool:
    """The memory's candidate (second) wins the verifier only with a strictly higher score: ties keep zero-shot."""
    return scores[1] > scores[0]
