"""Retrieval keys (input, soft_prompt_mean, kv) and the :class:`Retriever`."""

from elm_memory.retrieval.keys import InputKeyBuilder, KeyBuilder, KVKeyBuilder, SoftPromptMeanKeyBuilder
from elm_memory.retrieval.retriever import Hit, Retriever

__all__ = ["Hit", "InputKeyBuilder", "KVKeyBuilder", "KeyBuilder", "Retriever", "SoftPromptMeanKeyBuilder"]
