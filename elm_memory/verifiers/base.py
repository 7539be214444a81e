"""The verifier protocol, the candidate it scores, the config-driven factory, and the
teacher-forcing helper shared by the verifiers that read the policy model.

When the zero-shot and the memory-conditioned answers disagree, ELM scores both
responses with a :class:`Verifier` and keeps the higher score. A verifier is chosen by
``verifier.name`` through :data:`elm_memory.verifiers.registry.verifiers`:

``prm``
    a process reward model (Qwen2.5-Math-PRM style), its own model, loaded lazily.
``self_certainty``
    the policy's mean KL(uniform || p) over the response tokens (Kang et al. 2025).
``logprob``
    the policy's mean token log-probability of the response.
``consistency``
    the fraction of a few fresh zero-shot samples whose answer agrees with the response's
    (needs only ``backend.generate``, so it works with every backend).

Third parties register more through the ``elm_memory.verifiers`` entry-point group; the
target is either a class with a ``from_config(cfg, backend)`` classmethod or a callable
``factory(cfg, backend)``, and must return an object with ``name`` and ``score``.

Scores only need to be comparable *within one call*: ``score`` receives all candidates
for one question. An empty response scores :data:`EMPTY_SCORE` (``-inf``), so it never
beats a non-empty one and two empty ones tie.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from elm_memory.backends.base import GenerateRequest, PromptInput
from elm_memory.errors import BackendError, RegistryError

if TYPE_CHECKING:
    import torch

    from elm_memory.config import ELMConfig

log = logging.getLogger(__name__)

#: Score of an empty response (no tokens, or nothing left after truncation).
EMPTY_SCORE: float = -math.inf

#: How policy-model verifiers condition a response when scoring it (see ``PolicyVerifier``).
Conditioning = Literal["plain", "own"]


@dataclass(frozen=True)
class Candidate:
    """One response to score.

    ``text``: the decoded response (what a PRM reads). ``token_ids``: the completion's
    token ids as generated (what policy-model verifiers teacher-force); ``None`` means
    "tokenise ``text``". ``prompt``: the :class:`PromptInput` the response was generated
    from (token ids plus the memory's soft prompt, if any); ``None`` means "the plain
    prompt built from the question with the configured template". ``kind`` is a free
    label (``"zero_shot"``, ``"memory"``) for logs; no verifier reads it.
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    prompt: PromptInput | None = None
    kind: str = ""

    def __post_init__(self) -> None:
        if self.token_ids is not None and not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))


@runtime_checkable
class Verifier(Protocol):
    """Scores candidate responses to one question; higher is better."""

    name: str

    def score(self, question: str, responses: Sequence[Candidate]) -> list[float]:
        """One float per response, in order. Never raises on empty responses."""
        ...


@runtime_checkable
class SamplingVerifier(Protocol):
    """A verifier whose scores come from fresh samples of the question. The graph can draw them ahead,
    in the same decode batch as the two candidates, and score a disagreement with them later, so the
    samples cost batch rows instead of a decode of their own (``presample``)."""

    name: str
    presample: bool  # draw the samples with the candidates (where the backend batches calls)

    def sample_request(self, question: str, prompt: PromptInput | None = None) -> GenerateRequest:
        """The ``generate`` call that draws the samples (``prompt``: the question's zero-shot prompt)."""
        ...

    def sample_answers_of(self, generations: Sequence[Any]) -> list[str | None]:
        """The final answers of the generations that call returned, all its rows flattened in order."""
        ...

    def score_with_samples(self, answers: Sequence[str | None], samples: Sequence[str | None]) -> list[float]:
        """Scores of the candidates' final ``answers`` given the drawn samples' answers."""
        ...

    def samples_to_score(
        self,
        question: str,
        answers: Sequence[str | None],
        samples: Sequence[str | None] | None,
        responses: Sequence[Any] = (),
    ) -> list[str | None]:
        """What the graph calls before scoring: the samples drawn ahead (None: none were, draw them now),
        plus any the verifier draws now (e.g. on a tie). The graph scores on them and records how many."""
        ...


def build_verifier(cfg: ELMConfig, backend: Any = None) -> Verifier:
    """The verifier named by ``cfg.verifier.name`` (built-in or plugin).

    Verifiers that read the policy model get ``backend`` injected; the PRM ignores it and
    loads ``cfg.verifier.model`` itself, lazily, on the first ``score`` call.
    Unknown names raise :class:`~elm_memory.errors.RegistryError` listing what exists.
    """
    from elm_memory.verifiers.registry import verifiers

    name = cfg.verifier.name
    factory = verifiers.get(name)
    from_config = getattr(factory, "from_config", None)
    verifier = from_config(cfg, backend) if callable(from_config) else factory(cfg, backend)
    if not isinstance(verifier, Verifier):
        raise RegistryError(f"verifier {name!r} built a {type(verifier).__name__}, which has no name/score")
    return verifier


# ---- policy-model verifiers ---------------------------------------------------------


class PolicyVerifier:
    """Base of the verifiers that teacher-force responses through the policy model.

    Conditioning (``conditioning``):

    ``"plain"`` (default)
        every candidate is scored under the *plain zero-shot prompt* (its prompt's token
        ids with the soft prompt removed). The memory was trained with GRPO on the
        majority answer of *its own* question, which sharpens the policy's distribution
        towards that answer: scoring the memory response under its memory would
        reward that sharpening rather than the response, and the memory may come from a
        merely similar question. Under one shared prompt both responses are judged by the
        same distribution (the frozen base model's), so their scores are comparable;
        like the PRM, the verifier then sees only question + response.
    ``"own"``
        each candidate under the prompt it was generated from, soft prompt included
        (how confident the policy that wrote it was). Not comparable across candidates
        in the sense above; offered for analysis.

    Long responses: prompt + response must fit ``backend.info.max_context``; the response
    is cut to its first ``max_context - prompt_length`` tokens (the prefix a causal model
    can score unchanged) and a warning is logged. Nothing left -> :data:`EMPTY_SCORE`.
    All forwards run under ``torch.no_grad()`` with the model in eval mode.
    """

    name = "policy"

    def __init__(
        self,
        backend: Any,
        *,
        conditioning: Conditioning = "plain",
        prompt_config: Any = None,
        chunk_size: int = 256,
    ):
        if backend is None or getattr(backend, "model", None) is None:
            which = getattr(backend, "name", type(backend).__name__)
            why = "no backend was given" if backend is None else f"backend {which!r} does not expose one"
            raise BackendError(
                f"verifier {self.name!r} needs the policy model, but {why}; "
                "use backend.name=hf, or a verifier with its own model (verifier.name=prm)"
            )
        if conditioning not in ("plain", "own"):
            raise ValueError(f"conditioning must be 'plain' or 'own', got {conditioning!r}")
        self.backend = backend
        self.conditioning = conditioning
        self.prompt_config = prompt_config
        self.chunk_size = chunk_size
        self._zero_shot = ZeroShotPrompts(backend, prompt_config)

    @classmethod
    def from_config(cls, cfg: ELMConfig, backend: Any = None) -> PolicyVerifier:
        return cls(backend, prompt_config=cfg.prompt, conditioning=cfg.verifier.conditioning)

    # -- scoring -------------------------------------------------------------------
    def score(self, question: str, responses: Sequence[Candidate]) -> list[float]:
        out = []
        for cand in responses:
            ids = self._response_ids(cand)
            if not ids:
                out.append(EMPTY_SCORE)
                continue
            prompt = self._scoring_prompt(question, cand)
            per_token = response_token_scores(self.backend, prompt, ids, self.token_scores, chunk_size=self.chunk_size)
            out.append(per_token.double().mean().item() if per_token.numel() else EMPTY_SCORE)
        return out

    def token_scores(self, logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token scores (n,) from float32 log-probabilities (n, V) and the response tokens (n,)."""
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------
    def _response_ids(self, cand: Candidate) -> tuple[int, ...]:
        if cand.token_ids is not None:
            return cand.token_ids
        if not cand.text:
            return ()
        return tuple(self.backend.tokenizer(cand.text, add_special_tokens=False)["input_ids"])

    def _scoring_prompt(self, question: str, cand: Candidate) -> PromptInput:
        if cand.prompt is None:
            return self._zero_shot(question)
        if self.conditioning == "plain":
            return PromptInput(cand.prompt.token_ids)
        return cand.prompt


class ZeroShotPrompts:
    """The zero-shot answer prompt of a question (:meth:`PromptBuilder.answer_prompt`), for
    candidates that come without their prompt. The builder is made on first use: candidates
    from the graph and the evaluation carry their prompt and never need it."""

    def __init__(self, backend: Any, prompt_config: Any = None):
        self.backend = backend
        self.prompt_config = prompt_config
        self._builder: Any = None

    def __call__(self, question: str) -> PromptInput:
        if self._builder is None:
            from elm_memory.backends.prompting import PromptBuilder

            self._builder = PromptBuilder(self.backend.tokenizer, self.prompt_config)
        return self._builder.answer_prompt(question, memory_tokens=0).zero_shot()


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """``model.eval()`` for the block, restoring training mode afterwards if it was on."""
    was_training = bool(getattr(model, "training", False))
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


def response_token_scores(
    backend: Any,
    prompt: PromptInput,
    response_ids: Sequence[int],
    token_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Teacher-forced per-token scores (n,) float32 of a response; empty if nothing fits.

    One forward of prompt (+ soft prompt) + response through
    :func:`~elm_memory.backends.teacher_forcing.completion_logits`. The response positions'
    logits become float32 log-probabilities ``chunk_size`` rows at a time and
    ``token_fn(logp (c, V), targets (c,)) -> (c,)`` reduces each chunk, so a long response
    over a large vocabulary never holds a float32 (n, V) copy at once.
    The response is truncated to fit ``backend.info.max_context`` (see :class:`PolicyVerifier`).
    """
    import torch

    if prompt.length == 0:
        raise ValueError("cannot score a response without a prompt (no position predicts its first token)")
    max_context = getattr(getattr(backend, "info", None), "max_context", None)
    ids = list(response_ids)
    if max_context is not None and prompt.length + len(ids) > max_context:
        keep = max(0, max_context - prompt.length)
        log.warning(
            "verifier: prompt (%d) + response (%d tokens) exceed the context of %d; scoring the first %d tokens",
            prompt.length,
            len(ids),
            max_context,
            keep,
        )
        ids = ids[:keep]
    if not ids:
        return torch.zeros(0)
    from elm_memory.backends.teacher_forcing import completion_logits

    n = len(ids)
    with torch.no_grad(), eval_mode(backend.model):
        logits, targets, _ = completion_logits(backend.model, [prompt], [ids])
        parts = []
        for start in range(0, n, chunk_size):
            logp = torch.log_softmax(logits[0, start : start + chunk_size].float(), dim=-1)
            parts.append(token_fn(logp, targets[0, start : start + chunk_size]).float().cpu())
        return torch.cat(parts)
