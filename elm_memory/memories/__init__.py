"""Memory parameterisations (``memory.kind``): what a memory's trained weights are and how they condition
the frozen model.

- ``soft_prompt`` (paper's choice): k vectors inserted into the input embeddings; applied by the
  backends themselves through ``PromptInput.soft_prompt`` (no adapter object).
- ``lora`` (:mod:`elm_memory.memories.lora`): a low-rank delta on the attention and MLP projections,
  added by forward hooks only while the memory is applied; the shared model's weights never change.
- ``prefix`` (:mod:`elm_memory.memories.prefix`): per-layer key/value vectors placed in the KV cache
  before the prompt (prefix tuning).

``lora`` and ``prefix`` memories travel as a :class:`~elm_memory.memories.base.MemoryAdapter` in
``PromptInput.memory``. The kind names and their check are in :mod:`elm_memory.memories.base`; a
memory file's tensors per kind are read and checked by :class:`elm_memory.memory.LatentMemory`, and
:func:`elm_memory.training.learn.initial_memory` gives each kind its initialisation.
"""

from elm_memory.memories.base import KINDS, SOFT_PROMPT, AppliedMemory, MemoryAdapter, check_kind

__all__ = ["KINDS", "SOFT_PROMPT", "AppliedMemory", "MemoryAdapter", "check_kind"]
