"""``learner.mode: ray``: the answering side. ``submit`` writes the job to the ledger (the
durable SQLite queue of this host) and returns; Ray actors elsewhere learn it.

This module never imports Ray, so answering goes on whether or not a cluster is reachable:
jobs wait in the ledger. With ``learner.ray.dispatcher: auto`` the learner also starts a
:class:`~elm_memory.jobs.ray_dispatch.DispatcherSupervisor` (a child process that is the Ray
driver, restarted when it exits); with ``external``, ``elm learner serve`` on this host does
it. See :mod:`elm_memory.jobs.ray_dispatch` for the dispatcher, the actors and the guarantees.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from elm_memory.errors import ConfigError
from elm_memory.jobs.learner import LearnerOptions, LearnFn, QueueLike
from elm_memory.jobs.queue_learner import QueueLearner
from elm_memory.jobs.records import LearnerError, LearnJob, LearnTicket

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.jobs.ray_dispatch import DispatcherSupervisor

log = logging.getLogger("elm_memory.jobs")


def _not_here(job: LearnJob) -> str | None:
    raise LearnerError("learner.mode ray learns on Ray actors, not in the answering process")


class RayLearner(QueueLearner):
    """Records jobs in the ledger; a dispatcher sends them to Ray actors. ``wait`` polls the ledger.

    ``close`` never waits for learning (jobs are durable; they resume with the next dispatcher):
    it stops the dispatcher this learner started, which releases its jobs."""

    mode = "ray"

    def __init__(
        self, queue: QueueLike, *, config: ELMConfig, worker_factory: Any = None, start: bool = True, **kwargs: Any
    ):
        if config.learner.ray.dispatcher == "auto" and start and worker_factory is None:
            raise ConfigError("learner.ray.dispatcher=auto needs the actors' factory (ELM passes its class)")
        super().__init__(_not_here, queue, **kwargs)
        self.config = config
        self.supervisor: DispatcherSupervisor | None = None
        if config.learner.ray.dispatcher == "auto" and start:
            from elm_memory.jobs.ray_dispatch import DispatcherSupervisor

            log_path = Path(str(self.queue.path) + ".ray-dispatch.log")
            self.supervisor = DispatcherSupervisor(
                config, self.queue.path, worker_factory=worker_factory, log_path=log_path
            )
            self.supervisor.start()

    @classmethod
    def create(cls, learn_fn: LearnFn | None, queue: QueueLike | None, options: LearnerOptions) -> Self:
        if queue is None or options.config is None:
            raise ConfigError("learner mode 'ray' needs a queue path and the config")
        return cls(
            queue,
            config=options.config,
            worker_factory=options.worker_factory,
            scope=options.scope,
            max_attempts=options.max_attempts,
            poll_interval=options.poll_interval,
            batch_size=options.batch_size,
        )

    def submit(
        self, question: str, namespace: str = "default", *, config_overrides: dict[str, Any] | None = None
    ) -> LearnTicket:
        """Record the job durably (one SQLite transaction); never waits for learning or for Ray."""
        self._check_open()
        rec, created = self.queue.add(self._make_job(question, namespace, config_overrides))
        log.debug("submitted job %s (%s)", rec.job_id[:12], "new" if created else f"already {rec.state}")
        return self._ticket(rec, created)

    def wait(self, job_id: str | None = None, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._settled(job_id):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_interval if deadline is None else min(self.poll_interval, deadline - time.monotonic()))
        return True

    def status(self) -> dict[str, Any]:
        out = super().status()
        out["dispatcher"] = self.config.learner.ray.dispatcher
        if self.supervisor is not None:
            out["dispatcher_pid"] = self.supervisor.proc.pid if self.supervisor.proc else None
            out["dispatcher_restarts"] = self.supervisor.restarts
        return out

    def _worker_alive(self) -> bool:
        return self.supervisor.alive() if self.supervisor is not None else not self._closed

    def close(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self.supervisor is not None:
            self.supervisor.stop()
        self.queue.close()
