"""``learner.mode`` -> learner factory: when a memory is learned relative to answering (plugins: the
entry-point group ``elm_memory.learners``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elm_memory.plugins import Registry

if TYPE_CHECKING:
    from elm_memory.jobs.learner import LearnerFactory

learners: Registry[LearnerFactory] = Registry("learner mode", "elm_memory.learners")
learners.register("sync", "elm_memory.jobs.sync:SyncLearner")
learners.register("background", "elm_memory.jobs.background:BackgroundLearner")
learners.register("off", "elm_memory.jobs.off:NoLearner")
learners.register("ray", "elm_memory.jobs.ray_learner:RayLearner")  # extra .[ray]
