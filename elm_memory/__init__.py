"""elm-memory: Experiential Latent Memory for LLM agents.

Answer a stream of questions, learn a latent memory (a soft prompt trained with GRPO on
majority-vote rewards) from each one, and retrieve it for similar questions later.
"""

from elm_memory import moved
from elm_memory.config import ELMConfig, section
from elm_memory.errors import ELMError

__all__ = ["ELM", "ELMConfig", "ELMError", "LatentMemory"]
__version__ = "0.1.0"

moved.install()  # old module paths keep importing for one release


def _registry(name: str) -> section.NamedParts:
    # config checks a name when it loads but imports no registry: the package root, which sits above
    # every layer, hands it the owners' registries (imported only when such a field is checked; none of
    # these modules imports torch, so a misspelt name fails before any model work)
    if name == "backends":
        from elm_memory.backends.registry import backends

        return backends
    if name == "verifiers":
        from elm_memory.verifiers.registry import verifiers

        return verifiers
    if name == "key_builders":
        from elm_memory.memory.key_registry import key_builders

        return key_builders
    if name == "stores":
        from elm_memory.store.registry import stores

        return stores
    if name == "learners":
        from elm_memory.jobs.registry import learners

        return learners
    if name == "training_engines":
        from elm_memory.training.registry import training_engines

        return training_engines
    raise KeyError(name)


section.use_registries(_registry)


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "ELM":
        from elm_memory.elm import ELM

        return ELM
    if name == "LatentMemory":
        from elm_memory.memory import LatentMemory

        return LatentMemory
    raise AttributeError(name)
