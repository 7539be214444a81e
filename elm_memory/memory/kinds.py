"""What every non-soft-prompt memory is to the code that runs the model: a :class:`MemoryAdapter`.

A soft prompt is input (``PromptInput.soft_prompt``) and needs no adapter. A ``lora`` or ``prefix``
memory changes the forward pass itself, so the backends and teacher forcing enter
:meth:`MemoryAdapter.apply` around the model calls of the prompts that carry it: LoRA installs forward
hooks (removed on exit), prefix tuning hands back a fresh KV cache that already holds its per-layer
keys and values. Either way the shared model is the same object with the same weights afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from elm_memory.errors import MemoryFormatError

SOFT_PROMPT = "soft_prompt"
LORA = "lora"
PREFIX = "prefix"
#: Several LoRA memories (or none) on the rows of one batch (:class:`~elm_memory.memory.lora.RowLoras`): never
#: stored, only what a backend applies when it decodes prompts of different LoRA memories together.
LORA_ROWS = "lora_rows"
#: Every memory kind this library can train, store and apply (``memory.kind``).
KINDS: tuple[str, ...] = (SOFT_PROMPT, LORA, PREFIX)


def check_kind(kind: Any) -> str:
    """``kind`` if it names a known memory kind, else :class:`MemoryFormatError` (it comes from files)."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise MemoryFormatError(f"unknown memory kind {str(kind)[:40]!r}; known: {', '.join(KINDS)}")
    return kind


@dataclass
class AppliedMemory:
    """What a forward pass under an applied memory starts from.

    ``cache``: a fresh transformers ``DynamicCache`` already holding the memory's per-layer prefix
    (``past_length`` positions, batch ``batch_size``), or None when the memory needs no cache (LoRA).
    The caller extends its attention mask by ``past_length`` ones in front and keeps its position ids
    counting its own tokens only (the prefix sits before position 0, as in PEFT's prefix tuning).
    """

    cache: Any | None = None
    past_length: int = 0
    #: called with the batch's new row order whenever the decode loop repeats or drops rows (a memory that
    #: conditions some rows only follows its rows; None for memories that treat every row alike)
    on_rows: Callable[[torch.Tensor], None] | None = None

    def select_rows(self, index: torch.Tensor) -> None:
        """The batch is now ``index`` of its previous rows (a prompt's rows repeated, finished rows dropped)."""
        if self.on_rows is not None:
            self.on_rows(index)

    def mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``attention_mask`` (B, T) with the prefix's ones in front (unchanged without a prefix)."""
        if not self.past_length:
            return attention_mask
        ones = attention_mask.new_ones(attention_mask.shape[0], self.past_length)
        return torch.cat([ones, attention_mask], dim=1)


@runtime_checkable
class MemoryAdapter(Protocol):
    """A ``lora`` or ``prefix`` memory's weights, ready to condition the frozen model."""

    kind: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights by their stored names (``lora.<module>.A``, ``prefix.<layer>.key``, ...)."""
        ...

    def parameters(self) -> list[torch.Tensor]:
        """The tensors training updates (in place)."""
        ...

    def apply(self, model: Any, batch_size: int) -> AbstractContextManager[AppliedMemory]:
        """Condition ``model`` on this memory for the forwards inside the ``with`` block (batch ``batch_size``).
        Raises :class:`~elm_memory.errors.IncompatibleMemoryError` when the weights do not fit the model."""
        ...

    def detached(self) -> MemoryAdapter:
        """A copy that no optimizer step changes (what one step's rollouts are sampled under)."""
        ...

    def digest(self) -> str:
        """sha256 of the weights (what a greedy cache keys a prompt on)."""
        ...


def digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def shared_memory(memories: Sequence[MemoryAdapter | None]) -> MemoryAdapter | None:
    """The one adapter a forward's prompts share (None: no adapter). Prompts with different adapters
    cannot share a forward (a hook or a prefix cache is per call): ``ValueError`` says so, and callers
    group them first (the ``hf`` backend does, the trainer scores one memory per forward)."""
    distinct = {id(m): m for m in memories}
    if len(distinct) > 1:
        raise ValueError("prompts with different lora/prefix memories (or with and without one) cannot share a forward")
    return next(iter(distinct.values())) if distinct else None


def no_memory() -> Iterator[AppliedMemory]:
    """What :meth:`MemoryAdapter.apply` yields for a forward without an adapter (for uniform call sites)."""
    yield AppliedMemory()
