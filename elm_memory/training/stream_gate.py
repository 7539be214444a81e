"""The amortization gate of a stream memory: decides, with no labels, when its greedy answer alone may answer.

A question that draws the vote's samples (every question during warm-up and probation, a share ``probe_share`` of
them while serving) gives the gate one paired reading: does the memory's greedy answer agree with the vote of the
samples, and does zero-shot's greedy answer? Only the questions where exactly one of the two agrees (discordant
pairs) carry information: ``win`` when it is the memory, ``loss`` when it is zero-shot. The samples' vote excludes
both greedy answers, so neither is compared with a vote it is part of; a tied vote is no reading.

``gate_test`` picks what opens it:

- ``superiority`` reads the discordant pairs with two one-sided CUSUM statistics (Page's test, a sequential
  probability ratio test that restarts at zero). **open** (warm-up or probation -> serving): H1 "the memory wins
  a share ``margin`` of discordant pairs" against H0 "half". A win adds log(margin / 0.5), a loss
  log((1 - margin) / 0.5); the gate opens when the sum reaches log(1 / alpha). **close** (serving -> probation):
  the mirror image, H1 "zero-shot wins a share ``margin``".
- ``non_inferiority`` reads every question with a clear vote as D = +1 (win), -1 (loss) or 0 (tie), and asks
  whether the memory agrees with the vote at least as often as zero-shot, less a ``tolerance``: it opens when a
  test martingale against H0 "E[D] <= -tolerance" reaches 1 / alpha (Ville's inequality makes that an
  alpha-level test however often it is read). Its bets are predictable plug-in Kelly fractions from the readings
  so far plus four neutral pseudo-readings. It closes on the mirror test against H0 "E[D] >= 0", that is when
  the memory falls behind zero-shot at all. Ties carry its evidence: a memory that mostly answers as zero-shot
  cannot be far behind it, which the discordant pairs alone cannot show in a few hundred questions.
- ``sample_share`` is the same test on a finer reading of every question, vote or not: D = the share of the samples
  that gave the memory's greedy answer less the share that gave zero-shot's (a soft vote, in [-1, 1]). A question
  whose samples split still says which greedy answer more of them support, so no question is lost to a tied vote.

Both keep log(1 / alpha) as the threshold of a log statistic, need ``min_questions`` readings before the gate may
open, and start afresh after every change of state. When the gate closes, the answer path votes again and the
memory returns to the version the gate approved when it opened.

Every change of state is a :class:`GateDecision` with the statistics that made it, kept in the namespace's history.
Pure Python, no torch: the state is JSON, stored beside the memory's versions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.answers.vote import vote_counts
from elm_memory.config import StreamTuning

WARMUP, SERVING, PROBATION = "warmup", "serving", "probation"
STATES = (WARMUP, SERVING, PROBATION)
SUPERIORITY, NON_INFERIORITY = "superiority", "non_inferiority"
SAMPLE_SHARE = "sample_share"
TESTS = (SUPERIORITY, NON_INFERIORITY, SAMPLE_SHARE)
_PSEUDO = (1, 1, 2)  # wins, losses, ties every bet starts from: mean 0, E[D^2] 0.5
_MAX_LOSS = 0.5  # no single reading takes more than half of a test's wealth


def samples_vote(samples: Sequence[str | None]) -> str | None:
    """The samples' own vote, with no greedy answer in it: the answer strictly more samples gave than any other
    (None on a tie or when none answered)."""
    ranked = sorted(vote_counts(samples), key=lambda v: -v[1])  # equivalence grouping once
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


@dataclass(frozen=True)
class GateReading:
    """One probed question: the memory's and zero-shot's greedy answers against the samples' vote."""

    memory_agrees: bool
    zero_shot_agrees: bool
    vote: str | None
    memory_share: float = 0.0  # the share of the samples that gave the memory's greedy answer
    zero_shot_share: float = 0.0  # ... and zero-shot's

    @classmethod
    def of(cls, memory: str | None, zero_shot: str | None, samples: Sequence[str | None]) -> GateReading:
        vote = samples_vote(samples)

        def share(answer: str | None) -> float:  # no answer is supported by nothing
            if answer is None or not samples:
                return 0.0
            return sum(s is not None and equivalent(s, answer) for s in samples) / len(samples)

        return cls(
            memory_agrees=vote is not None and equivalent(memory, vote),
            zero_shot_agrees=vote is not None and equivalent(zero_shot, vote),
            vote=vote,
            memory_share=share(memory),
            zero_shot_share=share(zero_shot),
        )

    @property
    def share_difference(self) -> float:
        """``sample_share``'s reading: the memory's share of the samples less zero-shot's."""
        return self.memory_share - self.zero_shot_share

    @property
    def outcome(self) -> str:
        """``win`` (only the memory agrees), ``loss`` (only zero-shot), ``tie`` (both or neither) or ``no_vote``."""
        if self.vote is None:
            return "no_vote"
        if self.memory_agrees != self.zero_shot_agrees:
            return "win" if self.memory_agrees else "loss"
        return "tie"


@dataclass
class GateDecision:
    """A change of the gate's state and why."""

    state: str  # the new state
    previous: str
    reason: str
    statistic: float
    threshold: float
    wins: int
    losses: int
    readings: int
    approved_version: int | None
    test: str = SUPERIORITY

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: How many of the newest turns' ids the gate keeps (a resumed graph re-runs the one node it stopped in).
RECENT_TURNS = 16


@dataclass
class AmortizationGate:
    """The gate's state and its two sequential statistics (see the module's docstring)."""

    margin: float = 0.75
    alpha: float = 0.05
    min_questions: int = 16
    test: str = SUPERIORITY
    tolerance: float = 0.05
    state: str = WARMUP
    open_stat: float = 0.0
    close_stat: float = 0.0
    readings: int = 0  # probed questions read since the last change of state
    wins: int = 0  # discordant pairs since the last change of state
    losses: int = 0
    ties: int = 0  # clear votes both or neither greedy answer agreed with, since the last change of state
    share_sum: float = 0.0  # sample_share: the readings' sum and sum of squares since the last change of state
    share_square_sum: float = 0.0
    total_readings: int = 0
    approved_version: int | None = None  # the version serving when the gate last opened
    decisions: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # outcomes over the whole stream
    # the newest turns read: a graph resumed from its checkpoint re-runs a learn node the gate may have read already
    read_turns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0.5 < self.margin < 1.0:
            raise ValueError(f"the gate's margin is a share of discordant pairs above one half, got {self.margin}")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"the gate's alpha must be in (0, 0.5), got {self.alpha}")
        if self.state not in STATES:
            raise ValueError(f"unknown gate state {self.state!r}; one of {STATES}")
        if self.test not in TESTS:
            raise ValueError(f"unknown gate test {self.test!r}; one of {TESTS}")
        if not 0.0 < self.tolerance < 0.5:
            raise ValueError(f"the gate's tolerance is a difference of agreement rates in (0, 0.5): {self.tolerance}")

    @property
    def threshold(self) -> float:
        return math.log(1.0 / self.alpha)

    @property
    def serving(self) -> bool:
        """Whether the memory's greedy answer answers alone (with a share of probes)."""
        return self.state == SERVING

    def outcome_of(self, reading: GateReading) -> str:
        """What this gate's test reads in ``reading``: its outcome against the vote, or for ``sample_share`` (where
        every question is a reading) the sign of the share difference."""
        if self.test != SAMPLE_SHARE:
            return reading.outcome
        d = reading.share_difference
        return "win" if d > 0 else "loss" if d < 0 else "tie"

    def record(self, reading: GateReading) -> dict[str, Any]:
        """What an answer's ``stream_update.gate`` shows of a reading this gate has read."""
        shares = [round(reading.memory_share, 4), round(reading.zero_shot_share, 4)]
        return {"outcome": self.outcome_of(reading), "vote": reading.vote, "shares": shares, "state": self.state}

    def observe(self, reading: GateReading, version: int, *, turn: str | None = None) -> GateDecision | None:
        """Read one probed question (drawn with memory ``version``; ``turn``: its turn's id, remembered so that the
        turn is read once); the decision when the state changes."""
        if turn is not None:
            self.read_turns = [*self.read_turns, turn][-RECENT_TURNS:]
        outcome = self.outcome_of(reading)
        if self.test == SAMPLE_SHARE:
            self._bet_share(reading.share_difference)  # the bets use the readings before this one
        elif self.test == NON_INFERIORITY:
            self._bet(outcome)
        else:
            self._cusum(outcome)
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.readings += 1
        self.total_readings += 1
        if outcome == "win":
            self.wins += 1
        elif outcome == "loss":
            self.losses += 1
        elif outcome == "tie":
            self.ties += 1
        if self.state != SERVING and self.open_stat >= self.threshold and self.readings >= self.min_questions:
            reason = {
                SUPERIORITY: "memory agrees with the vote more often than zero-shot",
                NON_INFERIORITY: f"memory agrees with the vote at least as often as zero-shot, less {self.tolerance:g}",
                SAMPLE_SHARE: f"the samples give the memory's answer at least as often as zero-shot's, less "
                f"{self.tolerance:g}",
            }[self.test]
            return self._change(SERVING, reason, version)
        if self.state == SERVING and self.close_stat >= self.threshold:
            return self._change(PROBATION, "zero-shot agrees with the vote more often than the memory", None)
        return None

    def _cusum(self, outcome: str) -> None:
        up, down = math.log(self.margin / 0.5), math.log((1.0 - self.margin) / 0.5)
        if outcome == "win":
            self.open_stat = max(0.0, self.open_stat + up)
            self.close_stat = max(0.0, self.close_stat + down)
        elif outcome == "loss":
            self.open_stat = max(0.0, self.open_stat + down)
            self.close_stat = max(0.0, self.close_stat + up)

    def _bet(self, outcome: str) -> None:
        """Log-wealth of the two test martingales (the module's docstring); a question without a clear vote bets
        nothing."""
        if outcome not in ("win", "loss", "tie"):
            return
        d = {"win": 1.0, "loss": -1.0, "tie": 0.0}[outcome]
        self._wager(d, self.wins + self.losses + self.ties, self.wins - self.losses, self.wins + self.losses)

    def _bet_share(self, d: float) -> None:
        """:meth:`_bet` for ``sample_share``, whose readings are any number in [-1, 1]."""
        self._wager(d, self.readings, self.share_sum, self.share_square_sum)
        self.share_sum += d
        self.share_square_sum += d * d

    def _wager(self, d: float, n: int, total: float, square_total: float) -> None:
        """Bet both test martingales on reading ``d``, from the ``n`` readings before it (their sum and sum of
        squares) and the pseudo-readings."""
        n += sum(_PSEUDO)
        mean = (total + _PSEUDO[0] - _PSEUDO[1]) / n
        second = (square_total + _PSEUDO[0] + _PSEUDO[1]) / n
        # open: H0 E[D] <= -tolerance, so D + tolerance >= -(1 - tolerance) bounds the loss of one reading
        tol = self.tolerance
        bet = _kelly(mean + tol, second + 2 * tol * mean + tol * tol, 1.0 - tol)
        self.open_stat += math.log1p(bet * (d + tol))
        # close: H0 E[-D] <= 0
        self.close_stat += math.log1p(_kelly(-mean, second, 1.0) * -d)

    def _change(self, state: str, reason: str, version: int | None) -> GateDecision:
        statistic = self.open_stat if state == SERVING else self.close_stat
        decision = GateDecision(
            state=state,
            previous=self.state,
            reason=reason,
            statistic=round(statistic, 4),
            threshold=round(self.threshold, 4),
            wins=self.wins,
            losses=self.losses,
            readings=self.readings,
            approved_version=version if state == SERVING else self.approved_version,
            test=self.test,
        )
        if state == SERVING:
            self.approved_version = version
        self.state = state
        self._restart()
        self.decisions += 1
        return decision

    def _restart(self) -> None:
        """A fresh test: what the statistics read since the last change of state, forgotten."""
        self.open_stat = self.close_stat = 0.0
        self.readings = self.wins = self.losses = self.ties = 0
        self.share_sum = self.share_square_sum = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(
        cls,
        data: dict[str, Any] | None,
        *,
        margin: float,
        alpha: float,
        min_questions: int,
        test: str = SUPERIORITY,
        tolerance: float = 0.05,
    ) -> AmortizationGate:
        """The stored state with the configured test (a changed setting applies from the next reading on; a changed
        test starts its statistics afresh, since the stored ones measure something else)."""
        fields = {k: v for k, v in (data or {}).items() if k in cls.__dataclass_fields__}
        changed = bool(data) and fields.get("test", SUPERIORITY) != test
        fields.update(margin=margin, alpha=alpha, min_questions=min_questions, test=test, tolerance=tolerance)
        gate = cls(**fields)
        if changed:
            gate._restart()
        return gate

    @classmethod
    def from_settings(cls, data: dict[str, Any] | None, settings: StreamTuning) -> AmortizationGate:
        """:meth:`from_json` with the test ``stream.tuning`` names (its ``gate_*`` settings)."""
        return cls.from_json(
            data,
            margin=settings.gate_margin,
            alpha=settings.gate_alpha,
            min_questions=settings.gate_min_questions,
            test=settings.gate_test,
            tolerance=settings.gate_tolerance,
        )


def _kelly(first: float, second: float, worst: float) -> float:
    """A bet's fraction on X = the reading less the null's mean, from its plug-in moments E[X] and E[X^2]: the
    Kelly fraction E[X] / E[X^2] when E[X] > 0 (none otherwise), capped so that a reading of X = -``worst`` loses
    at most ``_MAX_LOSS`` of the wealth."""
    if first <= 0.0:
        return 0.0
    return min(_MAX_LOSS / worst, first / second)
