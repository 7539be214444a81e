"""``store.kind`` -> memory store class (plugins: the entry-point group ``elm_memory.stores``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from elm_memory.plugins import Registry

if TYPE_CHECKING:  # chromadb and torch: only the types are needed here
    from elm_memory.config import StoreConfig
    from elm_memory.models.loading import ModelInfo
    from elm_memory.store.base import MemoryStoreBase


class StoreFactory(Protocol):
    """A memory store class: ``from_config(cfg.store, model=..., **options)`` opens it."""

    def from_config(self, cfg: StoreConfig, model: ModelInfo | None = None, **kwargs: Any) -> MemoryStoreBase: ...


stores: Registry[StoreFactory] = Registry("memory store", "elm_memory.stores")
stores.register("chroma", "elm_memory.store.chroma:ChromaMemoryStore")
