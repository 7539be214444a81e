"""The generation backend protocol: what the graph, the verifiers and the trainer need
from an inference engine, and nothing more.

A backend generates from token ids with an optional soft prompt (k x d) inserted at a
token position, or with an optional ``lora``/``prefix`` memory applied to the model
(``PromptInput.memory``, :mod:`elm_memory.memory`). Implementations: ``hf`` (transformers, here), ``vllm`` and
``vllm-server`` (prompt embeddings). Selected by ``backend.name`` through the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from elm_memory.memory.kinds import MemoryAdapter
    from elm_memory.models.loading import ModelInfo

FinishReason = Literal["stop", "length", "answer"]


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings for one backend call (applied to every prompt in it)."""

    max_new_tokens: int = 2048
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # completions per prompt
    seed: int | None = None
    stop_at_answer: bool = False  # end a sequence once a \boxed{} answer is closed
    logprobs: bool = False  # per-token log-probabilities of the chosen tokens (temperature 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def answer_budget(limit: int, max_context: int, prompt_tokens: int, reserve: int = 0) -> int:
    """New tokens a call may ask for: ``limit``, cut to the context left after the prompt and
    ``reserve`` (e.g. a soft prompt), never below 1. Every answer path uses this one rule, so
    equal prompts get equal budgets (the evaluation cache relies on it)."""
    return max(1, min(limit, max_context - prompt_tokens - reserve))


@dataclass(frozen=True)
class PromptInput:
    """Token ids plus an optional soft prompt inserted before token ``soft_prompt_at``.

    ``seed``: this prompt's own sampling seed. When set, the prompt's completions depend on
    it alone, not on the other prompts of the call or their order (what training several
    memories in one call needs to equal training each alone). The ``hf`` backend honours it;
    backends that do not fall back to the call's ``SamplingParams.seed``.

    ``memory``: a ``lora`` or ``prefix`` memory to apply to the model for this prompt (never
    together with a soft prompt). It adds no token to the prompt: a prefix lives in the KV cache.
    """

    token_ids: tuple[int, ...]
    soft_prompt: torch.Tensor | None = None  # (k, hidden)
    soft_prompt_at: int = 0
    seed: int | None = None
    memory: MemoryAdapter | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.soft_prompt_at <= len(self.token_ids):
            raise ValueError(f"soft_prompt_at={self.soft_prompt_at} outside 0..{len(self.token_ids)}")
        if self.memory is not None and self.soft_prompt is not None:
            raise ValueError("a prompt carries a soft prompt or a lora/prefix memory, not both")
        if self.soft_prompt is not None and self.soft_prompt.dim() != 2:
            raise ValueError(f"soft prompt must be (k, hidden), got shape {tuple(self.soft_prompt.shape)}")

    @property
    def length(self) -> int:
        k = 0 if self.soft_prompt is None else self.soft_prompt.shape[0]
        return len(self.token_ids) + k


@dataclass
class Generation:
    """One completion."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


PromptLike = PromptInput | str | Sequence[int]


@runtime_checkable
class GenerationBackend(Protocol):
    """Batched generation with optional soft prompts. ``generate`` returns ``n`` completions per prompt."""

    name: str
    info: ModelInfo
    tokenizer: Any

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]: ...


#: One ``generate`` call's arguments.
GenerateRequest = tuple[Sequence[PromptLike], SamplingParams]


def generate_requests(backend: Any, requests: Sequence[GenerateRequest]) -> list[list[list[Generation]]]:
    """What ``backend.generate`` returns for each request: one ``generate_many`` call where the backend has
    one (the HF backend decodes the calls as one batch, each under its own params), else one call each."""
    many = getattr(backend, "generate_many", None)
    if len(requests) > 1 and callable(many):
        return list(many(requests))
    return [backend.generate(prompts, params) for prompts, params in requests]


def sampling_seed(prompt: PromptInput, params: SamplingParams, index: int) -> int | None:
    """The seed prompt ``index`` of a call samples with: its own ``PromptInput.seed``, else
    ``params.seed + index * n`` (vLLM gives a request's n samples consecutive streams); None for
    greedy decoding or when nothing is seeded. Every backend uses this rule."""
    if params.greedy:
        return None
    if prompt.seed is not None:
        return prompt.seed
    return None if params.seed is None else params.seed + index * params.n


def to_prompt_input(prompt: PromptLike, tokenizer: Any) -> PromptInput:
    """Normalise text / token ids / PromptInput to PromptInput (text is tokenised as-is)."""
    if isinstance(prompt, PromptInput):
        return prompt
    if isinstance(prompt, str):
        return PromptInput(tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return PromptInput(tuple(int(t) for t in prompt))


def compose_embeddings(prompt: PromptInput, embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(L, hidden) input embeddings: tokens[:at] + soft prompt + tokens[at:].

    ``embed`` maps a 1-D LongTensor of ids to (n, hidden) with the model's own table;
    the soft prompt is cast to that table's dtype and device.
    """
    import torch

    ids = torch.tensor(prompt.token_ids, dtype=torch.long)
    tok = embed(ids)
    if prompt.soft_prompt is None:
        return tok
    soft = prompt.soft_prompt.to(device=tok.device, dtype=tok.dtype)
    if soft.shape[1] != tok.shape[1]:
        from elm_memory.errors import IncompatibleMemoryError

        raise IncompatibleMemoryError(
            f"soft prompt has hidden size {soft.shape[1]} but the model's is {tok.shape[1]}: "
            "this memory was made for another model"
        )
    at = prompt.soft_prompt_at
    return torch.cat([tok[:at], soft, tok[at:]], dim=0)
