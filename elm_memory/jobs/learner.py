"""What a memory learner is, and how one is built from ``learner.mode``.

A learner accepts questions (``submit``) and sees to it that a memory is learned from each:
inline (``sync``), by a worker thread (``background``), by Ray actors on other machines (``ray``)
or not at all (``off``). The modes
are registered in :data:`elm_memory.jobs.registry.learners` (plugins: the entry-point group
``elm_memory.learners``); :func:`build_learner` picks one by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from elm_memory.errors import ConfigError, RegistryError
from elm_memory.jobs.queue import JobQueue
from elm_memory.jobs.records import JobRecord, LearnJob, LearnTicket
from elm_memory.jobs.registry import learners

#: Learns one job's memory and returns its id (see the idempotency contract in :mod:`elm_memory.jobs`).
LearnFn = Callable[[LearnJob], "str | None"]
#: Learns several jobs together: one entry per job, in order; an Exception entry fails that job alone.
LearnManyFn = Callable[[list[LearnJob]], "Sequence[str | None | Exception]"]
QueueLike = JobQueue | str | os.PathLike[str]


@runtime_checkable
class MemoryLearner(Protocol):
    """Accepts questions to learn memories from; see :mod:`elm_memory.jobs` for the contract."""

    mode: str

    def submit(
        self, question: str, namespace: str = "default", *, config_overrides: dict[str, Any] | None = None
    ) -> LearnTicket: ...

    def wait(self, job_id: str | None = None, timeout: float | None = None) -> bool:
        """Block until ``job_id`` (default: every queued job) is done or failed; False on timeout."""
        ...

    def job(self, job_id: str) -> JobRecord | None: ...

    def status(self) -> dict[str, Any]: ...

    def close(self, wait: bool = True) -> None: ...

    def __enter__(self) -> MemoryLearner: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@dataclass(frozen=True)
class LearnerOptions:
    """How a queue-driven learner runs its jobs: the ``learner`` config section's values, the
    scope mixed into job ids (the model fingerprint) and the optional batch learner."""

    scope: str = ""
    max_attempts: int = 3
    poll_interval: float = 1.0
    batch_size: int = 1
    learn_many_fn: LearnManyFn | None = None
    config: Any = None  # the ELMConfig, for learners that start processes of their own (``ray``)
    #: what such a learner's worker processes build from the config to learn with: the facade class,
    #: passed in by it (jobs never imports the facade); an importable ``module:qualname`` target
    worker_factory: Any = None


class LearnerFactory(Protocol):
    """What the ``learners`` registry holds: a learner class whose ``create`` builds it (a mode that
    needs no queue ignores ``learn_fn``, ``queue`` and most options)."""

    def create(self, learn_fn: LearnFn | None, queue: QueueLike | None, options: LearnerOptions) -> MemoryLearner: ...


def build_learner(
    mode: str,
    learn_fn: LearnFn | None,
    queue_path: QueueLike | None,
    *,
    scope: str = "",
    max_attempts: int = 3,
    poll_interval: float = 1.0,
    batch_size: int = 1,
    learn_many_fn: LearnManyFn | None = None,
    config: Any = None,
    worker_factory: Any = None,
) -> MemoryLearner:
    """The learner for ``LearnerConfig.mode``. ``queue_path`` is the SQLite file (see
    :func:`~elm_memory.jobs.records.default_queue_path`); ``scope`` is mixed into job ids (use the
    model fingerprint); ``batch_size`` jobs at most are learned together by ``learn_many_fn``
    (see :mod:`elm_memory.jobs`)."""
    try:
        factory = learners.get(mode)
    except RegistryError as exc:  # a bad mode is a config mistake, like every other config value
        raise ConfigError(str(exc)) from None
    options = LearnerOptions(scope, max_attempts, poll_interval, batch_size, learn_many_fn, config, worker_factory)
    return factory.create(learn_fn, queue_path, options)
