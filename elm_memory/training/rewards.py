"""The TTRL reward: no ground truth, the group's majority answer is the label."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elm_memory.answers import Vote, extract_answer, majority_rewards, majority_vote


@dataclass(frozen=True)
class GroupReward:
    answers: list[str | None]
    vote: Vote
    rewards: list[float]

    @property
    def uniform(self) -> bool:
        """All rewards equal: zero advantage for everyone, so no policy gradient."""
        return len(set(self.rewards)) <= 1


def majority_vote_rewards(completions: Sequence[str]) -> GroupReward:
    """r_i = 1 if answer_i is equivalent to the majority answer, else 0 (no answer -> 0)."""
    answers = [extract_answer(c) for c in completions]
    vote = majority_vote(answers)
    return GroupReward(answers=answers, vote=vote, rewards=majority_rewards(answers, vote))
