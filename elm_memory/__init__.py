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


def _registered_names(registry: str) -> list[str]:
    # config checks a name when it loads but imports no registry: the package root, which sits above
    # every layer, hands it the owners' registries (imported only when such a field is checked)
    if registry == "learners":
        from elm_memory.jobs.registry import learners

        return learners.names()
    if registry == "training_engines":
        from elm_memory.training.registry import training_engines

        return training_engines.names()
    raise KeyError(registry)


section.use_registered_names(_registered_names)


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "ELM":
        from elm_memory.elm import ELM

        return ELM
    if name == "LatentMemory":
        from elm_memory.memory import LatentMemory

        return LatentMemory
    raise AttributeError(name)
