"""Name -> implementation registries, so a config string picks a class.

Built-ins register themselves by import path (nothing heavy is imported until a name is
used). Third parties add implementations through entry points in the groups
``elm_memory.backends``, ``elm_memory.verifiers``, ``elm_memory.key_builders``,
``elm_memory.stores`` and ``elm_memory.eval_methods``::

    [project.entry-points."elm_memory.verifiers"]
    my_scorer = "my_pkg.scoring:MyVerifier"
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from elm_memory.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named set of factories: ``"module.path:Attr"`` strings or objects."""

    def __init__(self, kind: str, group: str):
        self.kind = kind
        self.group = group
        self._entries: dict[str, str | Callable[..., T]] = {}
        self._plugins_loaded = False

    def register(self, name: str, target: str | Callable[..., T] | None = None) -> Any:
        """``register("x", "pkg.mod:Cls")`` or as a decorator ``@register("x")``."""
        if target is not None:
            self._entries[name] = target
            return target

        def deco(obj: Callable[..., T]) -> Callable[..., T]:
            self._entries[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def get(self, name: str) -> Callable[..., T]:
        self._load_plugins()
        try:
            target = self._entries[name]
        except KeyError:
            raise RegistryError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                target = getattr(importlib.import_module(module), attr)
            except ImportError as exc:
                raise RegistryError(f"{self.kind} {name!r} needs a missing dependency: {exc}") from None
            self._entries[name] = target
        return target

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=self.group):
            self._entries.setdefault(ep.name, ep.value)


backends: Registry[Any] = Registry("backend", "elm_memory.backends")
backends.register("hf", "elm_memory.backends.hf:HFBackend")

verifiers: Registry[Any] = Registry("verifier", "elm_memory.verifiers")
key_builders: Registry[Any] = Registry("key builder", "elm_memory.key_builders")
stores: Registry[Any] = Registry("memory store", "elm_memory.stores")

key_builders.register("input", "elm_memory.retrieval.keys:InputKeyBuilder")
key_builders.register("soft_prompt_mean", "elm_memory.retrieval.keys:SoftPromptMeanKeyBuilder")
key_builders.register("kv", "elm_memory.retrieval.keys:KVKeyBuilder")
stores.register("chroma", "elm_memory.store.chroma:ChromaMemoryStore")
verifiers.register("prm", "elm_memory.verifiers.prm:PRMVerifier")
verifiers.register("self_certainty", "elm_memory.verifiers.self_certainty:SelfCertaintyVerifier")
verifiers.register("logprob", "elm_memory.verifiers.logprob:LogprobVerifier")
verifiers.register("consistency", "elm_memory.verifiers.consistency:ConsistencyVerifier")
# Prompt-embedding backends: vllm is imported only when an instance is created.
backends.register("vllm", "elm_memory.backends.vllm:VLLMBackend")
backends.register("vllm-server", "elm_memory.backends.vllm_server:VLLMServerBackend")

# Online evaluation methods (`elm stream --method NAME`): ELM and the paper's baselines.
eval_methods: Registry[Any] = Registry("evaluation method", "elm_memory.eval_methods")
eval_methods.register("zero_shot", "elm_memory.eval.methods.baselines:ZeroShot")
eval_methods.register("verifier_at_2", "elm_memory.eval.methods.baselines:verifier_at_2")
eval_methods.register("icl", "elm_memory.eval.methods.text_memory:ICL")
eval_methods.register("reasoning_bank", "elm_memory.eval.methods.text_memory:ReasoningBank")
eval_methods.register("elm_input", "elm_memory.eval.methods.elm_method:elm_input")
eval_methods.register("elm_kv", "elm_memory.eval.methods.elm_method:elm_kv")
