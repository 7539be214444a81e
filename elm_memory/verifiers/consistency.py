r"""``consistency``: self-consistency as a verifier. When the zero-shot and the memory answers
disagree, draw a few fresh zero-shot samples of the question and score each candidate by
the fraction of samples whose final ``\boxed{}`` answer is equivalent to the candidate's.

Why: it asks the same question ELM's training reward asks (does the answer agree with the
model's majority?), needs no second model, and only needs ``backend.generate``, so it also
works with the vLLM backends, which expose no model for teacher forcing.

Details:

* The samples use the plain zero-shot prompt: the first candidate's prompt token ids with
  any soft prompt dropped (the graph passes the prompt it answered with), else the prompt
  built from the question with ``prompt`` config. Under a memory the samples would lean
  towards that memory's answer, and the memory may come from a merely similar question.
* One batched ``backend.generate`` call of ``samples`` rows, one prompt row per sample with
  ``n = 1`` and its own seed from (``seed``, question, sample index) (:mod:`.seeding`), so sample j
  of a question is the same draw whichever call, batch or sample count draws it; each stops at its
  first closed ``\boxed{}``. A sample cut off
  before its box has no answer and agrees with nobody; it still counts in the denominator,
  so a score is always "agreeing samples / samples drawn".
* A candidate without an answer (no box, empty text) scores 0.0. Equal scores are equal
  floats, so the graph's strict ``memory > zero-shot`` rule keeps zero-shot on a tie.
* Answers are compared with :func:`elm_memory.answers.equivalent` (the vote's own rule).
* ``presample`` (:class:`~elm_memory.verifiers.base.SamplingVerifier`): the graph draws the samples
  in the same decode batch as the two candidates whenever a memory was retrieved, and the score
  reads them: the same prompt, params and seed as the call drawn after a disagreement, except
  that a sample is cut at the answers' token budget when that is shorter. A
  decode step costs about the same for a few more rows, so the samples then cost rows in a batch
  that runs anyway instead of a decode of their own; the rows are wasted when the candidates agree.
* ``tie_samples`` (adaptive consistency): when the best score is shared by two answered candidates,
  a tie the graph would settle for zero-shot whatever the memory answered, draw that many more
  samples (one call, sample indices after the first ``samples``, so they are new draws) and score on
  all of them. Only ties pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import GenerateRequest, Generation, PromptInput, SamplingParams, answer_budget
from elm_memory.errors import BackendError, ConfigError
from elm_memory.verifiers.base import Candidate, ZeroShotPrompts
from elm_memory.verifiers.seeding import sample_seeds, seeded_rows

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig


def agreement_scores(answers: Sequence[str | None], samples: Sequence[str | None]) -> list[float]:
    """The verifier's score of each answer on ``samples``: agreeing samples / samples drawn (None: no answer,
    0.0). A function of the recorded answers alone, so a run's records can be re-scored without a model."""
    total = len(samples)
    return [0.0 if a is None or not total else sum(equivalent(a, s) for s in samples) / total for a in answers]


class ConsistencyVerifier:
    """Fraction of fresh zero-shot samples that agree with each candidate's answer."""

    name = "consistency"

    def __init__(
        self,
        backend: Any,
        *,
        samples: int = 4,
        max_new_tokens: int = 512,
        temperature: float = 0.7,
        top_p: float = 1.0,
        seed: int | None = 42,
        prompt_config: Any = None,
        presample: bool = True,
        tie_samples: int = 0,
    ):
        if backend is None or not callable(getattr(backend, "generate", None)):
            raise BackendError(
                "verifier 'consistency' samples answers from the policy, but no backend with generate() was given"
            )
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"verifier.consistency_samples must be an integer >= 1, got {samples!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"verifier.consistency_max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not temperature > 0.0:  # also rejects NaN
            raise ConfigError(
                f"verifier.consistency_temperature must be > 0 (greedy samples are all one answer), got {temperature!r}"
            )
        if isinstance(tie_samples, bool) or not isinstance(tie_samples, int) or tie_samples < 0:
            raise ConfigError(f"verifier.consistency_tie_samples must be an integer >= 0, got {tie_samples!r}")
        self.backend = backend
        self.samples = samples
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = seed
        self.prompt_config = prompt_config
        self.presample = bool(presample)
        self.tie_samples = tie_samples
        self._zero_shot = ZeroShotPrompts(backend, prompt_config)

    @classmethod
    def from_config(cls, cfg: ELMConfig, backend: Any = None) -> ConsistencyVerifier:
        v = cfg.verifier
        return cls(
            backend,
            samples=v.consistency_samples,
            max_new_tokens=v.consistency_max_new_tokens,
            temperature=v.consistency_temperature,
            top_p=cfg.generation.top_p,
            seed=cfg.training.seed,  # the run's one seed, as the answer and the rollouts use
            prompt_config=cfg.prompt,
            presample=v.consistency_presample,
            tie_samples=v.consistency_tie_samples,
        )

    # -- scoring -------------------------------------------------------------------
    def score(self, question: str, responses: Sequence[Candidate]) -> list[float]:
        return self.score_answers(question, [extract_answer(c.text) if c.text else None for c in responses], responses)

    def score_answers(
        self, question: str, answers: Sequence[str | None], responses: Sequence[Candidate] = ()
    ) -> list[float]:
        """:meth:`score` on final answers already extracted (e.g. a run's recorded candidates);
        ``responses`` only supplies the prompt the samples are drawn from."""
        return self.score_with_samples(answers, self.samples_to_score(question, answers, None, responses))

    def samples_to_score(
        self,
        question: str,
        answers: Sequence[str | None],
        samples: Sequence[str | None] | None,
        responses: Sequence[Candidate] = (),
    ) -> list[str | None]:
        """The samples the scores count: ``samples`` drawn ahead (None: draw them now), plus
        ``tie_samples`` more when those tie the answers."""
        if not any(a is not None for a in answers):
            return list(samples or [])  # nothing to agree with: no sampling
        drawn = list(self.sample_answers(question, responses) if samples is None else samples)
        if self.tie_samples and self.is_tie(answers, self.score_with_samples(answers, drawn)):
            drawn += self.sample_answers(question, responses, n=self.tie_samples, start=self.samples)
        return drawn

    @staticmethod
    def is_tie(answers: Sequence[str | None], scores: Sequence[float]) -> bool:
        """The best score is shared by two or more answered candidates (the route cannot tell them apart)."""
        answered = [s for a, s in zip(answers, scores, strict=True) if a is not None]
        return len(answered) > 1 and answered.count(max(answered)) > 1

    def score_with_samples(self, answers: Sequence[str | None], samples: Sequence[str | None]) -> list[float]:
        """Agreeing samples / samples drawn, per answer (None: no answer, 0.0)."""
        return agreement_scores(answers, samples)

    def sample_answers(
        self, question: str, responses: Sequence[Candidate] = (), *, n: int | None = None, start: int = 0
    ) -> list[str | None]:
        """The zero-shot answers of one batched, seeded generate call (None: no box): ``samples`` of them,
        or ``n``, being samples ``start ..`` of the question (a later start draws other samples)."""
        prompts, params = self.sample_request(question, self._sampling_prompt(question, responses), n=n, start=start)
        return self.sample_answers_of([g for gens in self.backend.generate(prompts, params) for g in gens])

    def sample_seeds(self, question: str, n: int | None = None, start: int = 0) -> list[int | None]:
        """The seeds of samples ``start .. start + n - 1`` of ``question`` (None where the run is unseeded)."""
        return sample_seeds(self.seed, question, self.samples if n is None else n, start)

    def sample_request(
        self, question: str, prompt: PromptInput | None = None, *, n: int | None = None, start: int = 0
    ) -> GenerateRequest:
        """The seeded call that draws the samples from ``prompt`` (default: the question's zero-shot prompt):
        one prompt row per sample, each with its own seed (see :mod:`elm_memory.verifiers.seeding`)."""
        prompt = self._zero_shot(question) if prompt is None else PromptInput(prompt.token_ids)
        max_context = getattr(getattr(self.backend, "info", None), "max_context", None)
        budget = (
            self.max_new_tokens
            if max_context is None
            else answer_budget(self.max_new_tokens, max_context, len(prompt.token_ids))
        )
        params = SamplingParams(
            max_new_tokens=budget,
            temperature=self.temperature,
            top_p=self.top_p,
            n=1,
            seed=self.seed,  # a backend that ignores the rows' own seeds falls back to it
            stop_at_answer=True,  # only the first box is read; the rest would be wasted tokens
        )
        return seeded_rows(prompt, self.sample_seeds(question, n, start)), params

    def sample_answers_of(self, generations: Sequence[Generation]) -> list[str | None]:
        """The answers of the sample rows' generations, flattened in row order."""
        return [extract_answer(g.text) for g in generations]

    def _sampling_prompt(self, question: str, responses: Sequence[Candidate]) -> PromptInput:
        for cand in responses:
            if cand.prompt is not None:
                return PromptInput(cand.prompt.token_ids)  # soft prompt dropped: zero-shot
        return self._zero_shot(question)
