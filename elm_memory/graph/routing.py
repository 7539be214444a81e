"""The route rule on two candidate answers, as a pure function: the graph's ``route`` node uses it, and
an evaluation replays it on recorded answers (:mod:`elm_memory.eval.paired`), so the two cannot drift."""

from __future__ import annotations

from collections.abc import Sequence

from elm_memory.answers import equivalent
from elm_memory.answers.vote import plurality_vote

__all__ = ["AGREE", "ANSWERED", "VERIFIER", "VOTE", "ZERO_SHOT", "memory_wins", "route_of", "voted_answer"]

ZERO_SHOT, AGREE, ANSWERED, VERIFIER, VOTE = "zero_shot", "agree", "answered", "verifier", "vote"


def route_of(
    zero_shot: str | None, memory: str | None, *, has_memory: bool, prefer_answered: bool, vote: bool = False
) -> str:
    """Which rule decides: with ``vote`` (``verifier.route=vote``) always the vote, memory or not. Otherwise
    no memory candidate (zero-shot), equivalent answers (agree), exactly one answered when ``prefer_answered``
    (answered), else the verifier."""
    if vote:
        return VOTE
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


def voted_answer(zero_shot: str | None, samples: Sequence[str | None], memory: str | None = None) -> str | None:
    """The ``vote`` route's answer: the majority of the zero-shot answer, the samples and the memory's
    answer, counted in that order, so a tie goes to zero-shot's class when it is among the tied, else to the
    answer seen first, the memory's last: the ``self_consistency`` baseline's rule (:func:`plurality_vote`)
    with the memory as the last sample."""
    return plurality_vote([*samples, memory], zero_shot, with_greedy=True)
