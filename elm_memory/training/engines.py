"""Training engines by name (``training.engine``): what an engine is, and how one is built.

An engine trains soft prompts: :class:`Trainer` is its protocol. The ``training_engines``
registry (:data:`elm_memory.training.registry.training_engines`; plugins: the entry-point group
``elm_memory.training_engines``) maps a name to a :class:`TrainerFactory`, a callable that
builds the engine from the config, the loaded model and the generation backend. Every engine
returns a soft prompt and :class:`~elm_memory.memory.TrainingStats`, so their memories have
the same format.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from elm_memory.backends.base import GenerationBackend
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.models.loading import LoadedModel
from elm_memory.training.native import NativeTrainer, StepCallback, TrainResult
from elm_memory.training.registry import training_engines


class Trainer(Protocol):
    """Trains memories: ``train`` one, ``train_many`` several ``(prompt_ids, init, at)`` together. ``init`` is a
    soft prompt, or a lora/prefix adapter (:mod:`elm_memory.memory`) for engines that train those."""

    engine: str

    def train(
        self,
        prompt_ids: Any,
        init: torch.Tensor,
        *,
        at: int = 0,
        objective: str | None = None,
        progress: bool | None = None,
    ) -> TrainResult: ...

    def train_many(
        self,
        prompts: Any,
        *,
        objective: str | None = None,
        progress: bool | None = None,
        on_step: StepCallback | None = None,
    ) -> list[TrainResult]: ...


class TrainerFactory(Protocol):
    """What the ``training_engines`` registry holds."""

    def __call__(self, config: ELMConfig, loaded: LoadedModel, backend: GenerationBackend) -> Trainer: ...


def native_trainer(config: ELMConfig, loaded: LoadedModel, backend: GenerationBackend) -> Trainer:
    """``native``: rollouts from the backend, forward/backward in transformers."""
    return NativeTrainer(loaded, backend, config.training, config.memory)


def trl_trainer(config: ELMConfig, loaded: LoadedModel, backend: GenerationBackend) -> Trainer:
    """``trl``: TRL's GRPOTrainer with PEFT prompt tuning (its own rollouts; the backend is unused)."""
    if config.memory.kind != "soft_prompt":
        # TRL would need its own PEFT LoRA/prefix wrapping of the shared model; the native engine trains them
        raise ConfigError(
            f"training.engine=trl trains soft-prompt memories only; memory.kind={config.memory.kind} needs "
            "training.engine=native"
        )
    from elm_memory.training.trl_engine import TRLTrainer  # trl is heavy and optional

    return TRLTrainer(loaded, config.training)


def build_trainer(config: ELMConfig, loaded: LoadedModel, backend: GenerationBackend) -> Trainer:
    """The engine named by ``config.training.engine``; an unknown name lists the known ones."""
    return training_engines.get(config.training.engine)(config, loaded, backend)
