"""Majority vote over sampled answers, and the TTRL reward it gives each answer.

Greedy clustering in order of appearance: an answer joins the first class whose
representative (first member) is equivalent, else opens a new class; None answers belong
to no class but count in ``total``. The largest class wins, ties go to the class that
appeared first, and its representative is the voted answer. The TTRL reward of an answer
is 1.0 if it is equivalent to the voted answer, else 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elm_memory.answers.equivalence import equivalent


@dataclass(frozen=True)
class Vote:
    """Outcome of a majority vote: the winning answer and how many of ``total`` agree."""

    answer: str | None
    count: int
    total: int  # all answers given, None included

    @property
    def share(self) -> float:
        return self.count / self.total if self.total else 0.0


def majority_vote(answers: Sequence[str | None], *, timeout: float | None = 2.0) -> Vote:
    """Greedy equivalence clustering; the largest class wins, ties by first appearance."""
    answers = list(answers)
    reps: list[str] = []  # first member of each class, in order of appearance
    counts: list[int] = []
    seen: dict[str, int] = {}  # identical strings land in the same class: compare once
    for ans in answers:
        if not isinstance(ans, str):
            continue
        idx = seen.get(ans)
        if idx is None:
            idx = next((i for i, rep in enumerate(reps) if equivalent(ans, rep, timeout=timeout)), -1)
            if idx < 0:
                reps.append(ans)
                counts.append(0)
                idx = len(reps) - 1
            seen[ans] = idx
        counts[idx] += 1
    if not reps:
        return Vote(None, 0, len(answers))
    best = max(range(len(reps)), key=lambda i: (counts[i], -i))  # ties: earliest class
    return Vote(reps[best], counts[best], len(answers))


def majority_rewards(
    answers: Sequence[str | None], vote: Vote | None = None, *, timeout: float | None = 2.0
) -> list[float]:
    """TTRL rewards: 1.0 for each answer equivalent to the majority answer, else 0.0."""
    answers = list(answers)
    if vote is None:
        vote = majority_vote(answers, timeout=timeout)
    if vote.answer is None:
        return [0.0] * len(answers)
    return [1.0 if equivalent(a, vote.answer, timeout=timeout) else 0.0 for a in answers]


def vote_counts(answers: Sequence[str | None]) -> list[tuple[str, int, int]]:
    """(answer, votes, first position) per distinct answer, grouped by equivalence, in first-seen order;
    None casts no vote."""
    groups: list[list[Any]] = []  # [representative, votes, first position]
    for position, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            if equivalent(group[0], answer):
                group[1] += 1
                break
        else:
            groups.append([answer, 1, position])
    return [(a, n, first) for a, n, first in groups]


def plurality_vote(
    samples: Sequence[str | None], greedy: str | None = None, *, with_greedy: bool = False
) -> str | None:
    """The self-consistency vote: the majority answer of ``samples`` (plus ``greedy`` as one more vote when
    ``with_greedy``). Ties: to the greedy answer when it is among the tied, else to the answer drawn first.
    Unlike :func:`majority_vote`, two identical answers that :func:`equivalent` cannot compare (empty after
    normalising) are two votes apart, as the baselines have always counted them."""
    votes = vote_counts(([greedy] if with_greedy else []) + list(samples))
    if not votes:
        return None
    top = max(n for _, n, _ in votes)
    tied = [(a, first) for a, n, first in votes if n == top]
    if with_greedy and greedy is not None and any(equivalent(greedy, a) for a, _ in tied):
        return greedy
    return min(tied, key=lambda t: t[1])[0]


def vote_margin(answers: Sequence[str | None]) -> float:
    """How clear a vote is: (votes of the winner - votes of the runner-up) / all answers, None included (0: a
    tie or no answer; 1: every answer agrees)."""
    counts = sorted((n for _, n, _ in vote_counts(answers)), reverse=True) + [0, 0]
    return (counts[0] - counts[1]) / len(answers) if answers else 0.0
