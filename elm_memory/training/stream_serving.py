"""How a stream memory's serving version conditions the answer path's rows: a soft prompt spliced in at the
memory's place, or a LoRA over the frozen base model (the untrained LoRA, B = 0, is the base model itself).
:class:`~elm_memory.training.stream.StreamMemory` serves through it; where it is trained is ``stream.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elm_memory.backends.base import PromptInput
from elm_memory.config import ELMConfig
from elm_memory.errors import MemoryKindError
from elm_memory.memory.kinds import LORA, SOFT_PROMPT
from elm_memory.memory.lora import LoraAdapter
from elm_memory.training.stream_samples import under_soft_prompt


class StreamServing:
    """The serving side of a stream memory: its tensors (``params``, ``init``) as rows' conditioning."""

    config: ELMConfig
    kind: str
    namespace: str
    params: dict[str, torch.nn.Parameter]
    init: dict[str, torch.Tensor]
    _served: LoraAdapter | None = None  # the serving version's copy (adapter())

    @property
    def init_is_base_model(self) -> bool:
        """Whether the untrained memory answers exactly as the base model (a LoRA from B = 0)."""
        return self.kind == LORA

    @property
    def soft(self) -> torch.Tensor:
        """The trained soft prompt itself (a soft-prompt stream memory only)."""
        if self.kind != SOFT_PROMPT:
            raise MemoryKindError(f"the stream memory of {self.namespace!r} is a lora memory, not a soft prompt")
        return self.params["soft_prompt"]

    @property
    def soft_prompt(self) -> torch.Tensor:
        """The serving version's soft prompt (a copy: later updates do not change it)."""
        return self.soft.detach().clone()

    def adapter(self, *, trainable: bool = False) -> LoraAdapter:
        """The serving LoRA (a copy, unless ``trainable``: then the tensors the optimizer updates)."""
        if self.kind != LORA:
            raise MemoryKindError(f"the stream memory of {self.namespace!r} is a soft prompt, not a lora memory")
        lora = LoraAdapter.over(dict(self.params), self.config.memory.lora_alpha)
        if trainable:
            return lora
        # one copy per version: backends key what they build from it by its digest, which a copy computes once
        if self._served is None:
            self._served = lora.detached()
        return self._served

    def serve(self, rows: Sequence[Any], at: int) -> list[PromptInput]:
        """The rows (seeds kept) conditioned on the serving version: on-policy greedy answers and samples."""
        return self.server()(rows, at)

    def server(self) -> Callable[[Sequence[Any], int], list[PromptInput]]:
        """:meth:`serve` over one copy of the serving version, for rows of many questions: one LoRA object for
        all of them, so the backend decodes them as one batch."""
        if self.kind == SOFT_PROMPT:
            soft = self.soft_prompt
            return lambda rows, at: under_soft_prompt(rows, soft, at)
        adapter = self.adapter()
        return lambda rows, at: [dataclasses.replace(p, memory=adapter) for p in rows]

    def serve_init(self, rows: Sequence[Any], at: int) -> list[PromptInput]:
        """The rows under the untrained memory (for a LoRA: the rows themselves, the base model)."""
        if self.kind == SOFT_PROMPT:
            return under_soft_prompt(rows, self.init["soft_prompt"], at)
        return list(rows)
