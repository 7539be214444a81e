"""elm-memory: Experiential Latent Memory for LLM agents.

Answer a stream of questions, learn a latent memory (a soft prompt trained with GRPO on
majority-vote rewards) from each one, and retrieve it for similar questions later.
"""

from elm_memory.config import ELMConfig
from elm_memory.errors import ELMError

__all__ = ["ELM", "ELMConfig", "ELMError", "LatentMemory"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "ELM":
        from elm_memory.elm import ELM

        return ELM
    if name == "LatentMemory":
        from elm_memory.memory import LatentMemory

        return LatentMemory
    raise AttributeError(name)
