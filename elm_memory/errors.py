"""Typed errors. Every error a user can cause derives from :class:`ELMError`.

The CLI prints ``str(error)`` on one line and exits non-zero; library users catch
the specific class. Messages say what was wrong and what to do about it.
"""

from __future__ import annotations


class ELMError(Exception):
    """Base class of every error elm-memory raises on purpose."""

    exit_code: int = 2


class ConfigError(ELMError, ValueError):
    """Unknown preset, unknown config key, invalid value or unreadable config file."""


class InvalidQuestionError(ELMError, ValueError):
    """Empty, non-text, undecodable or over-long question."""


class ModelIntegrityError(ELMError):
    """A model file is missing, truncated, or its sha256 differs from the pinned one."""


class ModelNotFoundError(ELMError):
    """A model name resolves to nothing we can load offline."""


class MemoryFormatError(ELMError, ValueError):
    """A memory file is not a valid ELM memory (shape, dtype, non-finite values, metadata)."""


class IncompatibleMemoryError(ELMError, ValueError):
    """A memory was made for another model (hidden size or embedding fingerprint differ)."""


class AdapterError(ELMError, ValueError):
    """A memory cannot be written as a PEFT prompt-tuning adapter (not a prefix memory), or a folder
    is not an adapter ELM can import (files, fields, token count)."""


class TrainingError(ELMError):
    """Memory training failed; nothing was written."""


class NonFiniteError(TrainingError):
    """NaN or inf appeared in the loss or the soft prompt; the memory is aborted."""


class StoreError(ELMError):
    """The memory store could not read or write."""


class MemoryNotFoundError(StoreError):
    """No memory with that id in the store (or in the given namespace)."""


class AmbiguousMemoryIdError(StoreError, LookupError):
    """A shortened memory id (an id prefix) that several memories start with; ``matches`` holds their full ids."""

    def __init__(self, message: str, matches: list[str] | None = None):
        super().__init__(message)
        self.matches = list(matches or [])


class InvalidNamespaceError(StoreError, ValueError):
    """Empty, over-long or non-printable namespace (checked before any model work)."""


class MemoryIdConflictError(StoreError):
    """A memory id is already used by another namespace or model in the store (ids are unique per store)."""


class MemoryWriteRefusedError(StoreError):
    """A value written into the memory store by hand (e.g. LangGraph's ``BaseStore.put``): memories are
    learned by ELM (``elm.learn``, the graph's learn step), never stored from a raw value."""


class InvalidStoreQueryError(StoreError, ValueError):
    """A search the store cannot run: an unknown filter operator, or an order comparison (``$gt`` ...)
    between a stored value and a value of another type."""


class RegistryError(ELMError, KeyError):
    """A config string names an implementation nobody registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendError(ELMError):
    """The generation backend is unavailable or failed."""


class DatasetError(ConfigError):
    """A question stream cannot be used: a vendored file fails its checksum, or a JSONL line has no usable
    question, gold answer or id (the message names the file and line; raised before any model loads)."""


class MemoryKindError(IncompatibleMemoryError):
    """A memory of one kind (``soft_prompt``, ``lora``, ``prefix``) used where another is needed: a lora
    memory as a soft prompt, a prefix memory on a backend that cannot apply one, a merge of adapters."""
