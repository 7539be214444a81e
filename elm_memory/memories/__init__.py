"""Deprecated: moved into :mod:`elm_memory.memory` (``memories.base`` is ``memory.kinds``; ``lora`` and
``prefix`` are ``memory.lora`` and ``memory.prefix``). This name keeps importing for one release."""

import warnings

from elm_memory.memory.kinds import KINDS, SOFT_PROMPT, AppliedMemory, MemoryAdapter, check_kind

warnings.warn(
    "elm_memory.memories moved to elm_memory.memory; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["KINDS", "SOFT_PROMPT", "AppliedMemory", "MemoryAdapter", "check_kind"]
