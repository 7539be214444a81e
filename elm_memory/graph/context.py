"""Runtime dependencies of the ELM graph, injected through LangGraph's ``context_schema``.

Nothing here is global: two ELM instances (two models, two stores) can run graphs side
by side. Any part may be None: no retriever means no memories (zero-shot only), no
learner means nothing is learned, no verifier means disagreements fall back to zero-shot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from elm_memory.backends.base import GenerationBackend
from elm_memory.config import ELMConfig
from elm_memory.models.prompting import PromptBuilder


@dataclass
class ELMContext:
    config: ELMConfig
    backend: GenerationBackend
    prompts: PromptBuilder
    retriever: Any | None = None  # elm_memory.retrieval.Retriever
    verifier: Any | None = None  # elm_memory.verifiers.Verifier
    learner: Any | None = None  # elm_memory.learner.MemoryLearner
    # Memories fetched by `retrieve` for `dual_generate` (state holds only their ids).
    memory_cache: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    cache_size: int = 64

    def remember(self, memory: Any) -> None:
        self.memory_cache[memory.id] = memory
        self.memory_cache.move_to_end(memory.id)
        while len(self.memory_cache) > self.cache_size:
            self.memory_cache.popitem(last=False)

    def memory(self, memory_id: str) -> Any:
        if memory_id in self.memory_cache:
            return self.memory_cache[memory_id]
        if self.retriever is None:
            raise KeyError(memory_id)
        memory = self.retriever.store.get(memory_id)
        self.remember(memory)
        return memory


# -- serving entry points ------------------------------------------------------------------
# `langgraph dev` / LangGraph Server cannot send live objects (models, stores) in a request,
# so a served graph registers a factory that builds them once per process. Library users
# pass `context=` explicitly and never touch this.
_default_factory: Any = None
_default_context: ELMContext | None = None


def set_default_context_factory(factory: Any) -> None:
    global _default_factory, _default_context
    _default_factory, _default_context = factory, None


def resolve_context(context: ELMContext | None) -> ELMContext:
    """The run's injected context, else the served graph's process-wide default."""
    global _default_context
    if context is not None:
        return context
    if _default_factory is None:
        from elm_memory.errors import ConfigError

        raise ConfigError("the ELM graph needs context=ELMContext(...) (see ELM.context())")
    if _default_context is None:
        _default_context = _default_factory()
    return _default_context
