"""Compute-matched voting baselines: what ELM's answers would be without the memory.

ELM's ``consistency`` verifier draws k zero-shot samples of the question and lets the memory's answer
win only when more samples agree with it than with the greedy answer. These methods spend the same
generations with no memory at all:

* ``self_consistency``: the greedy answer plus the same k samples, majority vote; a tie that includes
  the greedy answer goes to it. The compute is ELM's minus the memory candidate.
* ``maj_at_k``: the k samples alone, majority vote.

A tie between sample answers (without greedy among them) goes to the answer drawn first. A sample
without a boxed answer casts no vote; with no vote at all the answer is None. Answers are grouped by
:func:`~elm_memory.answers.equivalent` (the verifier's own rule), so "7" and "7.0" are one answer.

The samples are the verifier's: the same prompt, budget, temperature and per-sample seeds
(:mod:`elm_memory.verifiers.seeding`), so on a question where ELM drew its samples the baselines
vote on those very samples (up to the answers' token budget when ELM drew them ahead).
"""

from __future__ import annotations

from typing import Any

from elm_memory.answers.vote import plurality_vote as majority_vote
from elm_memory.answers.vote import vote_counts
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput
from elm_memory.eval.methods.baselines import ZeroShot, _Memoryless

__all__ = ["MajorityAtK", "SelfConsistency", "majority_vote", "vote_counts"]


class _Voting(_Memoryless):
    """k seeded zero-shot samples per question, drawn exactly as the ``consistency`` verifier draws them."""

    name = "voting"
    with_greedy = False

    def __init__(self, runtime: EvalRuntime):
        k = runtime.config.verifier.consistency_samples
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"{self.name} needs verifier.consistency_samples (k) >= 1, got {k!r}")
        self.runtime = runtime
        self.k = k
        self._verifier: Any = None
        self._zero_shot = ZeroShot(runtime) if self.with_greedy else None

    @property
    def sampler(self) -> Any:
        """A ``consistency`` verifier on the run's backend (whatever verifier ELM uses): its sample call."""
        if self._verifier is None:
            from elm_memory.verifiers.consistency import ConsistencyVerifier

            self._verifier = ConsistencyVerifier.from_config(self.runtime.config, self.runtime.backend)
        return self._verifier

    def sample_answers(self, questions: list[str]) -> list[list[str | None]]:
        """k sample answers per question; the rows of all questions sharing a budget decode as one call."""
        requests = [self.sampler.sample_request(q) for q in questions]
        by_budget: dict[int, list[int]] = {}
        for i, (_, params) in enumerate(requests):
            by_budget.setdefault(params.max_new_tokens, []).append(i)
        out: list[list[str | None]] = [[] for _ in questions]
        for members in by_budget.values():
            rows = [p for i in members for p in requests[i][0]]
            gens = self.runtime.backend.generate(rows, requests[members[0]][1])
            flat = [g for per_row in gens for g in per_row]
            for j, i in enumerate(members):
                out[i] = self.sampler.sample_answers_of(flat[j * self.k : (j + 1) * self.k])
        return out

    def answer_batch(self, questions: list[str], indices: list[int]) -> list[MethodOutput]:
        greedy = self._zero_shot.answer_batch(questions, indices) if self._zero_shot is not None else None
        outputs = []
        for i, (question, samples) in enumerate(zip(questions, self.sample_answers(questions), strict=True)):
            first = greedy[i] if greedy is not None else None
            answer = majority_vote(samples, first.answer if first else None, with_greedy=self.with_greedy)
            candidates = ([first.candidates[0]] if first else []) + [
                {"kind": f"sample_{j}", "answer": a, "score": None} for j, a in enumerate(samples)
            ]
            outputs.append(
                MethodOutput(
                    answer=answer,
                    response=first.response if first and first.answer == answer else "",
                    route="vote",
                    candidates=candidates,
                    extra={
                        "votes": [[a, n] for a, n, _ in vote_counts(([first.answer] if first else []) + samples)],
                        "verifier_sample_answers": samples,
                        "seeds": {"verifier_samples": self.sampler.sample_seeds(question)},
                    },
                )
            )
        return outputs


class SelfConsistency(_Voting):
    name = "self_consistency"
    with_greedy = True


class MajorityAtK(_Voting):
    name = "maj_at_k"
    with_greedy = False
