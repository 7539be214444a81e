"""Memory stores: the protocol and its base class, the blob directory and the Chroma implementation.

Names are imported lazily, so ``elm --help`` (which imports the ``memories`` CLI) pays
for neither torch nor chromadb.
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "CheckReport": "elm_memory.store.base",
    "MemoryNotFoundError": "elm_memory.store.base",
    "MemoryRecord": "elm_memory.store.base",
    "MemoryStore": "elm_memory.store.base",
    "MemoryStoreBase": "elm_memory.store.base",
    "StoreHit": "elm_memory.store.base",
    "BlobStore": "elm_memory.store.blobs",
    "MissingBlobError": "elm_memory.store.blobs",
    "ChromaMemoryStore": "elm_memory.store.chroma",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
