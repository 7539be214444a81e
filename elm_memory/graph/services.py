"""The live parts the ELM graph's nodes use: config, backend, prompts, retriever, verifier,
learner. Built once per process (``ELM.services()``, or a served graph's provider) and
bound to the graph when it is built -- never sent in a request.

Any part may be None: no retriever means no memories (zero-shot only), no learner means
nothing is learned, no verifier means disagreements fall back to zero-shot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elm_memory.backends.base import GenerationBackend
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the parts are built by ELM, which imports them lazily
    from elm_memory.jobs import MemoryLearner
    from elm_memory.memory import LatentMemory
    from elm_memory.retrieval.retriever import Retriever
    from elm_memory.training.stream import StreamMemory
    from elm_memory.verifiers.base import Verifier


class MemoryCache:
    """Memories fetched by ``retrieve`` for ``dual_generate`` (the state holds only ids).

    An LRU shared by every request thread of the process, so it takes a lock.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[str, LatentMemory] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, memory: LatentMemory) -> None:
        with self._lock:
            self._items[memory.id] = memory
            self._items.move_to_end(memory.id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, memory_id: str) -> LatentMemory | None:
        with self._lock:
            memory = self._items.get(memory_id)
            if memory is not None:
                self._items.move_to_end(memory_id)
            return memory

    def discard(self, memory_id: str) -> None:
        with self._lock:
            self._items.pop(memory_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


@dataclass
class ELMServices:
    config: ELMConfig
    backend: GenerationBackend
    prompts: PromptBuilder
    retriever: Retriever | None = None
    verifier: Verifier | None = None
    learner: MemoryLearner | None = None
    memories: MemoryCache = field(default_factory=MemoryCache)
    # ``stream.mode`` stream/both: the namespace's stream memory (one per namespace, built on first use)
    streams: Callable[[str], StreamMemory] | None = None

    def __post_init__(self) -> None:
        # a memory this process deletes (eviction on put, TTL expiry, an explicit delete) must not
        # live on in the cache (one deleted by another process is no longer retrieved, so its copy
        # here is never asked for again and ages out)
        add = getattr(getattr(self.retriever, "store", None), "add_delete_listener", None)
        if callable(add):
            add(self.memories.discard)

    def memory(self, memory_id: str) -> LatentMemory:
        """A retrieved memory: from the cache, else from the store."""
        memory = self.memories.get(memory_id)
        if memory is not None:
            return memory
        if self.retriever is None:
            raise KeyError(memory_id)
        memory = self.retriever.store.get(memory_id)
        self.memories.put(memory)
        return memory

    def stream_memory(self, namespace: str) -> StreamMemory:
        """The namespace's stream memory (``stream.mode`` stream or both)."""
        if self.streams is None:
            raise ConfigError(
                f"stream.mode={self.config.stream.mode} needs stream memories, but these services were built "
                "without them: build them with ELM(config).services()"
            )
        return self.streams(namespace)
