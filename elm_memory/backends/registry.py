"""``backend.name`` -> generation backend class (plugins: the entry-point group ``elm_memory.backends``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from elm_memory.plugins import Registry

if TYPE_CHECKING:  # the backends import torch: only their types are needed here
    from elm_memory.backends.base import GenerationBackend
    from elm_memory.config import ELMConfig
    from elm_memory.models.loading import LoadedModel


class BackendFactory(Protocol):
    """A generation backend class: ``from_config(cfg, loaded=...)`` builds it."""

    def from_config(self, cfg: ELMConfig, loaded: LoadedModel | None = None) -> GenerationBackend: ...


backends: Registry[BackendFactory] = Registry("backend", "elm_memory.backends")
backends.register("hf", "elm_memory.backends.hf:HFBackend")
# Prompt-embedding backends: vllm is imported only when an instance is created.
backends.register("vllm", "elm_memory.backends.vllm.engine:VLLMBackend")
backends.register("vllm-server", "elm_memory.backends.vllm.server_backend:VLLMServerBackend")
