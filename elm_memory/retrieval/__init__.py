"""Retrieval keys (input, soft_prompt_mean, kv, kv_centered) and the :class:`Retriever`."""

from elm_memory.memory.keys import (
    InputKeyBuilder,
    KeyBuilder,
    KVCenteredKeyBuilder,
    KVKeyBuilder,
    SoftPromptMeanKeyBuilder,
)
from elm_memory.retrieval.retriever import Hit, Retriever

__all__ = [
    "Hit",
    "InputKeyBuilder",
    "KVCenteredKeyBuilder",
    "KVKeyBuilder",
    "KeyBuilder",
    "Retriever",
    "SoftPromptMeanKeyBuilder",
]
