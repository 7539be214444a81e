"""``training.engine`` -> what trains a memory (plugins: the entry-point group
``elm_memory.training_engines``; see :mod:`elm_memory.training.engines`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elm_memory.plugins import Registry

if TYPE_CHECKING:
    from elm_memory.training.engines import TrainerFactory

training_engines: Registry[TrainerFactory] = Registry("training engine", "elm_memory.training_engines")
training_engines.register("native", "elm_memory.training.engines:native_trainer")
training_engines.register("trl", "elm_memory.training.engines:trl_trainer")
