r"""The collapse guard of a stream memory: reads the answers each version drew, decides when to roll back.

Intrinsic rewards are known to rise and then collapse under long training: answers lose their ``\boxed{}``
(format collapse), samples stop agreeing (noise), or every question gets the same answer (the majority
reward is maximised by a constant). The guard watches exactly those three on the answer path's own
generations, which cost nothing extra, over windows of ``window`` questions:

- **unboxed**: the share of the memory's answers (greedy + samples) with no ``\boxed{}``, against zero-shot's
  greedy answers on the same questions; rolled back when it exceeds it by more than ``max_unboxed_increase``;
- **agreement**: the mean majority share of the memory's answers; rolled back when it falls more than
  ``max_agreement_drop`` below the first window's (the memory's own starting point), and, when
  ``max_agreement_rise`` is set, when it rises more than that above it: samples collapsing onto one another
  (a LoRA trained on its own votes went from 0.40 to 0.78 while a sample stayed as often right), which a rise
  from real learning also shows, so this rule is off unless set;
- **repeated answer**: rolled back when one answer wins the vote on more than ``max_repeated_answer`` of the
  window's questions.

A rollback returns to the version that answered the window's first question. Answer entropy is recorded
beside them (it moves with agreement) but decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from elm_memory.answers import equivalent, majority_vote
from elm_memory.config import StreamTuning
from elm_memory.training.stream_gate import RECENT_TURNS


@dataclass(frozen=True)
class Observation:
    """What one answered question tells the guard: the memory version that drew the answers, and the answers."""

    version: int
    memory_answers: list[str | None]  # the memory's greedy answer, then its samples where it drew any
    zero_shot_answer: str | None
    label: str | None  # the memory's own vote over memory_answers (what the repeated-answer rule counts)
    turn: str | None = None  # the graph turn's id: a turn re-run after a stop is not read twice


@dataclass
class WindowStats:
    versions: list[int]
    unboxed: float
    zero_shot_unboxed: float
    agreement: float | None  # None when no question had two answers of the memory's to compare
    entropy: float
    repeated_answer: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    """One window's reading: its stats, and the reasons to roll back (none: keep going)."""

    stats: WindowStats
    reasons: list[str] = field(default_factory=list)
    rollback_to: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.to_dict(), "reasons": list(self.reasons), "rollback_to": self.rollback_to}

    def rollback_entry(self, version: int, question_hash: str) -> dict[str, Any]:
        """The history entry of ``version``, the rollback this verdict asks for (at the question hashed)."""
        assert self.rollback_to is not None
        return {
            "version": version,
            "rollback_to": self.rollback_to,
            "reasons": self.reasons,
            "window": self.stats.to_dict(),
            "question_hash": question_hash,
        }


class CollapseGuard:
    """Collects observations; every ``window`` of them it reads them and says whether to roll back."""

    def __init__(
        self,
        *,
        window: int = 8,
        max_unboxed_increase: float = 0.25,
        max_agreement_drop: float = 0.2,
        max_repeated_answer: float = 0.5,
        max_agreement_rise: float | None = None,
    ):
        if window < 2:
            raise ValueError(f"the guard's window must hold at least 2 questions, got {window}")
        self.window = window
        self.max_unboxed_increase = max_unboxed_increase
        self.max_agreement_drop = max_agreement_drop
        self.max_repeated_answer = max_repeated_answer
        self.max_agreement_rise = max_agreement_rise
        self.pending: list[Observation] = []
        self.baseline_agreement: float | None = None
        self.read_turns: list[str] = []  # the newest RECENT_TURNS turns read

    @classmethod
    def from_settings(cls, settings: StreamTuning) -> CollapseGuard:
        """A fresh guard with the thresholds ``stream.tuning`` names (its ``guard_*`` settings)."""
        return cls(
            window=settings.guard_window,
            max_unboxed_increase=settings.guard_max_unboxed_increase,
            max_agreement_drop=settings.guard_max_agreement_drop,
            max_repeated_answer=settings.guard_max_repeated_answer,
            max_agreement_rise=settings.guard_max_agreement_rise,
        )

    def observe(self, observation: Observation) -> Verdict | None:
        """Add one question; a full window is read and cleared (then a :class:`Verdict`, else None). A question on
        which the memory drew no answer (amortized, one the gate does not read) adds nothing."""
        if not observation.memory_answers:
            return None
        if observation.turn is not None:
            if observation.turn in self.read_turns:  # read before its turn stopped, then re-run
                return None
            self.read_turns = [*self.read_turns, observation.turn][-RECENT_TURNS:]
        self.pending.append(observation)
        if len(self.pending) < self.window:
            return None
        stats = window_stats(self.pending)
        verdict = Verdict(stats)
        if stats.unboxed > stats.zero_shot_unboxed + self.max_unboxed_increase:
            verdict.reasons.append(
                f"unboxed {stats.unboxed:.2f} > zero-shot's {stats.zero_shot_unboxed:.2f} + {self.max_unboxed_increase}"
            )
        if stats.agreement is None:
            pass  # one answer a question (a graph learning from zero-shot's rows): nothing to agree
        elif self.baseline_agreement is None:
            self.baseline_agreement = stats.agreement  # the first window is the memory's own starting point
        elif stats.agreement < self.baseline_agreement - self.max_agreement_drop:
            verdict.reasons.append(
                f"agreement {stats.agreement:.2f} < first window's {self.baseline_agreement:.2f} - "
                f"{self.max_agreement_drop}"
            )
        elif (
            self.max_agreement_rise is not None and stats.agreement > self.baseline_agreement + self.max_agreement_rise
        ):
            verdict.reasons.append(
                f"agreement {stats.agreement:.2f} > first window's {self.baseline_agreement:.2f} + "
                f"{self.max_agreement_rise}"
            )
        if stats.repeated_answer > self.max_repeated_answer:
            verdict.reasons.append(f"one answer won {stats.repeated_answer:.2f} of the window's votes")
        if verdict.reasons:
            verdict.rollback_to = self.pending[0].version
        self.pending = []
        return verdict

    def state(self) -> dict[str, Any]:
        """What a process continuing this stream needs (JSON)."""
        return {
            "pending": [asdict(o) for o in self.pending],
            "baseline_agreement": self.baseline_agreement,
            "read_turns": list(self.read_turns),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.pending = [Observation(**o) for o in state.get("pending", [])]
        self.baseline_agreement = state.get("baseline_agreement")
        self.read_turns = list(state.get("read_turns", []))


def window_stats(observations: Sequence[Observation]) -> WindowStats:
    answers = [a for o in observations for a in o.memory_answers]
    shares, entropies = [], []
    for o in observations:
        entropies.append(answer_entropy(o.memory_answers))
        if len(o.memory_answers) > 1:  # one answer agrees with itself when boxed: that is the unboxed rule's
            shares.append(majority_vote(o.memory_answers).share)
    labels = [o.label for o in observations if o.label is not None]
    repeated = max((sum(equivalent(a, b) for b in labels) for a in labels), default=0)
    n = len(observations)
    return WindowStats(
        versions=sorted({o.version for o in observations}),
        unboxed=sum(a is None for a in answers) / max(1, len(answers)),
        zero_shot_unboxed=sum(o.zero_shot_answer is None for o in observations) / max(1, n),
        agreement=sum(shares) / len(shares) if shares else None,
        entropy=sum(entropies) / max(1, n),
        repeated_answer=repeated / max(1, n),
    )


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the answers' classes (equivalent answers are one class; no answer is a class)."""
    classes: list[tuple[str | None, int]] = []
    for a in answers:
        for i, (rep, n) in enumerate(classes):
            if (a is None and rep is None) or (a is not None and rep is not None and equivalent(a, rep)):
                classes[i] = (rep, n + 1)
                break
        else:
            classes.append((a, 1))
    total = len(answers)
    return -sum((n / total) * math.log(n / total) for _, n in classes) if total else 0.0
