"""Name -> implementation registries, so a config string picks a class.

Built-ins register themselves by import path (nothing heavy is imported until a name is
used). Third parties add implementations through entry points in the groups
``elm_memory.backends``, ``elm_memory.verifiers``, ``elm_memory.key_builders``,
``elm_memory.stores``, ``elm_memory.eval_methods``, ``elm_memory.learners`` and
``elm_memory.training_engines``::

    [project.entry-points."elm_memory.verifiers"]
    my_scorer = "my_pkg.scoring:MyVerifier"

Each registry is typed by what a name resolves to: a class or factory that builds its part's
Protocol (``GenerationBackend``, ``Verifier``, ...). Where parts are built through a
``from_config`` classmethod, a small factory Protocol below says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from elm_memory.errors import RegistryError

if TYPE_CHECKING:  # the parts' modules import torch: only their types are needed here
    from elm_memory.backends.base import GenerationBackend
    from elm_memory.config import ELMConfig, StoreConfig
    from elm_memory.eval.methods.base import EvalMethod, EvalRuntime
    from elm_memory.jobs.learner import LearnerFactory
    from elm_memory.models.loading import LoadedModel, ModelInfo
    from elm_memory.retrieval.keys import KeyBuilder
    from elm_memory.store.base import MemoryStoreBase
    from elm_memory.training.engines import TrainerFactory
    from elm_memory.verifiers.base import Verifier

F = TypeVar("F")


class Registry(Generic[F]):
    """A named set of ``F`` (a class or factory): ``"module.path:Attr"`` strings or objects."""

    def __init__(self, kind: str, group: str):
        self.kind = kind
        self.group = group
        self._entries: dict[str, str | F] = {}
        self._plugins_loaded = False

    def register(self, name: str, target: str | F | None = None) -> Any:
        """``register("x", "pkg.mod:Cls")`` or as a decorator ``@register("x")``."""
        if target is not None:
            self._entries[name] = target
            return target

        def deco(obj: F) -> F:
            self._entries[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def get(self, name: str) -> F:
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
        return target  # an import path resolves to an F by contract (mypy takes getattr's Any on trust)

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=self.group):
            self._entries.setdefault(ep.name, ep.value)


class BackendFactory(Protocol):
    """A generation backend class: ``from_config(cfg, loaded=...)`` builds it."""

    def from_config(self, cfg: ELMConfig, loaded: LoadedModel | None = None) -> GenerationBackend: ...


class StoreFactory(Protocol):
    """A memory store class: ``from_config(cfg.store, model=..., **options)`` opens it."""

    def from_config(self, cfg: StoreConfig, model: ModelInfo | None = None, **kwargs: Any) -> MemoryStoreBase: ...


backends: Registry[BackendFactory] = Registry("backend", "elm_memory.backends")
backends.register("hf", "elm_memory.backends.hf:HFBackend")

# A verifier class is built by its ``from_config(cfg, backend)`` when it has one, else called with
# ``(cfg, backend)`` (see ``elm_memory.verifiers.base.build_verifier``).
verifiers: Registry[Callable[..., Verifier]] = Registry("verifier", "elm_memory.verifiers")
key_builders: Registry[Callable[[], KeyBuilder]] = Registry("key builder", "elm_memory.key_builders")
stores: Registry[StoreFactory] = Registry("memory store", "elm_memory.stores")

key_builders.register("input", "elm_memory.retrieval.keys:InputKeyBuilder")
key_builders.register("soft_prompt_mean", "elm_memory.retrieval.keys:SoftPromptMeanKeyBuilder")
key_builders.register("kv", "elm_memory.retrieval.keys:KVKeyBuilder")
key_builders.register("kv_centered", "elm_memory.retrieval.keys:KVCenteredKeyBuilder")
stores.register("chroma", "elm_memory.store.chroma:ChromaMemoryStore")
verifiers.register("prm", "elm_memory.verifiers.prm:PRMVerifier")
verifiers.register("self_certainty", "elm_memory.verifiers.self_certainty:SelfCertaintyVerifier")
verifiers.register("logprob", "elm_memory.verifiers.logprob:LogprobVerifier")
verifiers.register("consistency", "elm_memory.verifiers.consistency:ConsistencyVerifier")
# Prompt-embedding backends: vllm is imported only when an instance is created.
backends.register("vllm", "elm_memory.backends.vllm.engine:VLLMBackend")
backends.register("vllm-server", "elm_memory.backends.vllm.server_backend:VLLMServerBackend")

# Online evaluation methods (`elm stream --method NAME`): ELM and the paper's baselines.
eval_methods: Registry[Callable[[EvalRuntime], EvalMethod]] = Registry("evaluation method", "elm_memory.eval_methods")
eval_methods.register("zero_shot", "elm_memory.eval.methods.baselines:ZeroShot")
eval_methods.register("verifier_at_2", "elm_memory.eval.methods.baselines:verifier_at_2")
eval_methods.register("icl", "elm_memory.eval.methods.text_memory:ICL")
eval_methods.register("reasoning_bank", "elm_memory.eval.methods.text_memory:ReasoningBank")
eval_methods.register("lag", "elm_memory.eval.methods.lag:lag")
eval_methods.register("lag_tts", "elm_memory.eval.methods.lag:lag_tts")
eval_methods.register("elm_input", "elm_memory.eval.methods.elm_method:elm_input")
eval_methods.register("elm_kv", "elm_memory.eval.methods.elm_method:elm_kv")
eval_methods.register("elm_kv_centered", "elm_memory.eval.methods.elm_method:elm_kv_centered")
eval_methods.register("elm_untrained", "elm_memory.eval.methods.elm_method:elm_untrained")
eval_methods.register("self_consistency", "elm_memory.eval.methods.voting:SelfConsistency")
eval_methods.register("maj_at_k", "elm_memory.eval.methods.voting:MajorityAtK")

# Learner modes (`learner.mode`): when a memory is learned relative to answering (elm_memory.jobs).
learners: Registry[LearnerFactory] = Registry("learner mode", "elm_memory.learners")
learners.register("sync", "elm_memory.jobs.sync:SyncLearner")
learners.register("background", "elm_memory.jobs.background:BackgroundLearner")
learners.register("off", "elm_memory.jobs.off:NoLearner")
learners.register("ray", "elm_memory.jobs.ray_learner:RayLearner")  # extra .[ray]

# Training engines (`training.engine`): what trains a memory's soft prompt (elm_memory.training.engines).
training_engines: Registry[TrainerFactory] = Registry("training engine", "elm_memory.training_engines")
training_engines.register("native", "elm_memory.training.engines:native_trainer")
training_engines.register("trl", "elm_memory.training.engines:trl_trainer")
