"""elm-memory: Experiential Latent Memory for LLM agents.

Answer a stream of questions, learn a latent memory (a soft prompt trained with GRPO on
majority-vote rewards) from each one, and retrieve it for similar questions later.
"""

import importlib

from elm_memory import moved
from elm_memory.config import ELMConfig, section
from elm_memory.errors import ELMError

__all__ = ["ELM", "ELMConfig", "ELMError", "LatentMemory"]
__version__ = "0.1.0"

moved.install()  # old module paths keep importing for one release


# config checks a name when it loads but imports no registry: the package root, which sits above every
# layer, hands it the owners' registries, imported only when such a field is checked (none of these
# modules imports torch, so a misspelt name fails before any model work)
_REGISTRIES = {
    "backends": "elm_memory.backends.registry:backends",
    "verifiers": "elm_memory.verifiers.registry:verifiers",
    "key_builders": "elm_memory.memory.key_registry:key_builders",
    "stores": "elm_memory.store.registry:stores",
    "learners": "elm_memory.jobs.registry:learners",
    "training_engines": "elm_memory.training.registry:training_engines",
}


def _registry(name: str) -> section.NamedParts:
    module, _, attr = _REGISTRIES[name].partition(":")
    registry: section.NamedParts = getattr(importlib.import_module(module), attr)
    return registry


section.use_registries(_registry)


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "ELM":
        from elm_memory.elm import ELM

        return ELM
    if name == "LatentMemory":
        from elm_memory.memory import LatentMemory

        return LatentMemory
    raise AttributeError(name)
