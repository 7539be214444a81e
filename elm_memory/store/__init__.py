"""Memory stores: the protocol, the blob directory and the Chroma implementation.

``ChromaMemoryStore`` is imported lazily: chromadb is slow to import and not every
user of the records needs it.
"""

from typing import Any

from elm_memory.store.base import CheckReport, MemoryNotFoundError, MemoryRecord, MemoryStore, StoreHit
from elm_memory.store.blobs import BlobStore, MissingBlobError

__all__ = [
    "BlobStore",
    "CheckReport",
    "ChromaMemoryStore",
    "MemoryNotFoundError",
    "MemoryRecord",
    "MemoryStore",
    "MissingBlobError",
    "StoreHit",
]


def __getattr__(name: str) -> Any:
    if name == "ChromaMemoryStore":
        from elm_memory.store.chroma import ChromaMemoryStore

        return ChromaMemoryStore
    raise AttributeError(name)
