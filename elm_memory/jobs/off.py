"""``learner.mode: off``: nothing is learned, nothing is recorded.

Answers still get a ticket (status ``skipped``) with the job id the question would have had.
"""

from __future__ import annotations

from typing import Any

from elm_memory.jobs.learner import LearnerOptions, LearnFn, QueueLike
from elm_memory.jobs.records import STATES, JobRecord, LearnJob, LearnTicket


class NoLearner:
    """``mode: off``: nothing is learned, nothing is recorded."""

    mode = "off"

    def __init__(self, *, scope: str = ""):
        self.scope = scope

    @classmethod
    def create(cls, learn_fn: LearnFn | None, queue: QueueLike | None, options: LearnerOptions) -> NoLearner:
        """The registry's constructor: only ``options.scope`` matters (job ids in tickets); no queue is opened."""
        return cls(scope=options.scope)

    def submit(
        self, question: str, namespace: str = "default", *, config_overrides: dict[str, Any] | None = None
    ) -> LearnTicket:
        job = LearnJob.create(question, namespace, scope=self.scope, config_overrides=config_overrides)
        return LearnTicket(job.job_id, "skipped")

    def wait(self, job_id: str | None = None, timeout: float | None = None) -> bool:
        return True

    def job(self, job_id: str) -> JobRecord | None:
        return None

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, **dict.fromkeys(STATES, 0), "worker_alive": False, "current_job": None}

    def close(self, wait: bool = True) -> None:
        pass

    def __enter__(self) -> NoLearner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
