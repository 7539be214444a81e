"""The queue-driven learner: what the ``sync`` and ``background`` modes share.

It owns the :class:`~elm_memory.jobs.queue.JobQueue`, claims jobs for a worker, runs them
through the injected ``learn_fn`` (this package knows nothing about torch, models or stores)
and records each outcome; the subclasses decide on which thread that happens.

Batches. With ``batch_size > 1`` and a ``learn_many_fn(jobs) -> [memory_id | None |
Exception, ...]`` (one entry per job, in order), a worker claims up to ``batch_size``
pending jobs at once and learns them in one call (several memories trained together).
Each job keeps its own ledger row (claim, heartbeat, complete, fail). The batch is only an
optimisation: if ``learn_many_fn`` raises, or returns an Exception for a job, that job is
run again alone with ``learn_fn`` within the same attempt, and that run's outcome is what
is recorded, so one bad job fails alone and never takes its batch-mates with it.

Limits: ``learn_fn`` is not time-limited (a thread cannot be killed); a hung job holds the
single worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Self

from elm_memory.errors import ConfigError
from elm_memory.faults import point
from elm_memory.jobs.learner import LearnerOptions, LearnFn, LearnManyFn, QueueLike
from elm_memory.jobs.queue import JobQueue
from elm_memory.jobs.records import TERMINAL, JobRecord, LearnerError, LearnJob, LearnTicket, error_text

log = logging.getLogger("elm_memory.jobs")


class QueueLearner:
    """Shared parts of the queue-backed learners: the queue, running one job, waiting."""

    mode = "?"

    def __init__(
        self,
        learn_fn: LearnFn,
        queue: QueueLike,
        *,
        scope: str = "",
        max_attempts: int = 3,
        poll_interval: float = 1.0,
        batch_size: int = 1,
        learn_many_fn: LearnManyFn | None = None,
    ):
        if not callable(learn_fn):
            raise ConfigError("learn_fn must be callable")
        if learn_many_fn is not None and not callable(learn_many_fn):
            raise ConfigError("learn_many_fn must be callable")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError("learner batch_size must be an integer >= 1")
        self.queue = queue if isinstance(queue, JobQueue) else JobQueue(queue, max_attempts=max_attempts)
        self.learn_fn = learn_fn
        self.learn_many_fn = learn_many_fn
        # Without a learn_many_fn there is nothing to gain from holding several claims at once.
        self.batch_size = batch_size if learn_many_fn is not None else 1
        self.scope = scope
        self.poll_interval = poll_interval
        self._cv = threading.Condition()
        self._gen = 0  # bumped (under _cv) whenever a job changes state here
        self._closed = False
        self._current: str | None = None

    @classmethod
    def create(cls, learn_fn: LearnFn | None, queue: QueueLike | None, options: LearnerOptions) -> Self:
        """The registry's constructor (:class:`~elm_memory.jobs.learner.LearnerFactory`)."""
        if learn_fn is None or queue is None:
            raise ConfigError(f"learner mode {cls.mode!r} needs a learn_fn and a queue path")
        # the rest are this class's keywords
        kwargs = {k: v for k, v in vars(options).items() if k not in ("config", "worker_factory")}
        return cls(learn_fn, queue, **kwargs)

    def _ticket(self, rec: JobRecord, created: bool) -> LearnTicket:
        """``submit``'s answer for the job ``queue.add`` returned; one log line when the question was
        learned before (its memory is reused: nothing is learned again)."""
        ticket = LearnTicket.from_record(rec, duplicate=not created)
        if ticket.reused:
            log.info(
                "question already learned in namespace %r (job %s): reusing memory %s, no new memory learned",
                rec.job.namespace,
                rec.job_id[:12],
                (rec.memory_id or "")[:12],
            )
        return ticket

    # -- common API --------------------------------------------------------------------
    def job(self, job_id: str) -> JobRecord | None:
        return self.queue.get(job_id)

    def ticket(self, job_id: str) -> LearnTicket:
        rec = self.queue.get(job_id)
        if rec is None:
            raise LearnerError(f"no learn job {job_id!r} in {self.queue.path}")
        return LearnTicket.from_record(rec)

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            **self.queue.counts(),
            "worker_alive": self._worker_alive(),
            "current_job": self._current,
            "queue": str(self.queue.path),
        }

    def close(self, wait: bool = True) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(wait=exc_type is None)

    # -- internals ---------------------------------------------------------------------
    def _worker_alive(self) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise LearnerError(f"the {self.mode} learner is closed")

    def _make_job(self, question: str, namespace: str, config_overrides: dict[str, Any] | None) -> LearnJob:
        return LearnJob.create(question, namespace, scope=self.scope, config_overrides=config_overrides)

    def _notify(self) -> None:
        with self._cv:
            self._gen += 1
            self._cv.notify_all()

    def _settled(self, job_id: str | None) -> bool:
        if job_id is None:
            counts = self.queue.counts()
            return counts["pending"] == 0 and counts["running"] == 0
        rec = self.queue.get(job_id)
        if rec is None:
            raise LearnerError(f"no learn job {job_id!r} in {self.queue.path}")
        return rec.state in TERMINAL

    def _claim(self, owner: str) -> list[JobRecord]:
        """Up to ``batch_size`` of the oldest pending jobs, claimed for ``owner``."""
        return self.queue.claim_many(owner, self.batch_size)

    def _run_batch(self, recs: list[JobRecord], owner: str) -> None:
        """Learn claimed jobs together with ``learn_many_fn``; a job the batch did not complete
        (the call raised, or returned an Exception for it) runs again alone with ``learn_fn``."""
        if len(recs) == 1 or self.learn_many_fn is None:
            self._run_alone(recs, owner)
            return
        jobs = [r.job for r in recs]
        self._current = jobs[0].job_id
        log.info("learning %d jobs together: %s", len(jobs), ", ".join(j.job_id[:12] for j in jobs))
        t0 = time.monotonic()
        beating = self._start_heartbeat([j.job_id for j in jobs], owner)
        try:
            results = self._learn_together(self.learn_many_fn, recs, owner)
            alone = []
            for rec, result in zip(recs, results or [None] * len(recs), strict=True):
                if results is None or isinstance(result, BaseException):
                    alone.append(rec)
                else:
                    self._complete(rec.job, owner, result, t0)
            self._run_alone(alone, owner)
        finally:
            beating.set()
            self._current = None
            self._notify()

    def _learn_together(self, learn_many_fn: LearnManyFn, recs: list[JobRecord], owner: str) -> list[Any] | None:
        """``learn_many_fn``'s results, one per job; None when the batch as a whole failed (each job
        then runs alone). An interrupt releases every job of the batch, then propagates."""
        jobs = [r.job for r in recs]
        try:
            results = list(learn_many_fn(jobs))
        except Exception as exc:
            log.warning(
                "batch of %d jobs failed (%s: %s); running them one at a time", len(jobs), type(exc).__name__, exc
            )
            return None
        except BaseException:
            self._release(recs, owner)
            log.warning("batch of %d jobs interrupted; back to pending", len(jobs))
            raise
        if len(results) != len(jobs):
            log.warning("learn_many_fn returned %d results for %d jobs; running them alone", len(results), len(jobs))
            return None
        return results

    def _run_alone(self, recs: list[JobRecord], owner: str) -> None:
        """One job at a time; an interrupt releases the jobs not yet run, then propagates."""
        for i, rec in enumerate(recs):
            try:
                self._run_one(rec, owner)
            except BaseException:
                self._release(recs[i + 1 :], owner)
                raise

    def _start_heartbeat(self, job_ids: list[str], owner: str) -> threading.Event:
        """Keep the leases of ``job_ids`` alive until the returned event is set."""
        beating = threading.Event()
        threading.Thread(
            target=self._heartbeat, args=(job_ids, owner, beating), name="elm-memory-learner-heartbeat", daemon=True
        ).start()
        return beating

    def _release(self, recs: list[JobRecord], owner: str) -> None:
        for rec in recs:
            with contextlib.suppress(LearnerError):
                self.queue.release(rec.job_id, owner)

    def _complete(self, job: LearnJob, owner: str, memory_id: Any, t0: float) -> None:
        if memory_id is not None and not isinstance(memory_id, str):
            memory_id = str(memory_id)
        short = job.job_id[:12]
        point("job.learned")
        if self.queue.complete(job.job_id, owner, memory_id):
            log.info("job %s done in %.1fs -> memory %s", short, time.monotonic() - t0, memory_id)
        else:
            log.warning("job %s finished but was no longer held by this worker; not recorded again", short)

    def _run_one(self, rec: JobRecord, owner: str) -> None:
        """Run ``learn_fn`` on a claimed job and record the outcome. Exceptions are a failed
        attempt; interrupts (BaseException) release the job and propagate."""
        job = rec.job
        short = job.job_id[:12]
        self._current = job.job_id
        log.info(
            "learning job %s (attempt %d/%d, namespace %r)", short, job.attempts, self.queue.max_attempts, job.namespace
        )
        t0 = time.monotonic()
        beating = self._start_heartbeat([job.job_id], owner)
        try:
            memory_id = self.learn_fn(job)
        except Exception as exc:
            error = error_text(exc)
            after = self.queue.fail(job.job_id, owner, error)
            if after is None:
                log.warning("job %s failed (%s) but was no longer held by this worker", short, error)
            elif after.state == "failed":
                log.error("job %s failed for good after %d attempts: %s", short, job.attempts, error, exc_info=exc)
            else:
                log.warning("job %s attempt %d failed, will retry: %s", short, job.attempts, error, exc_info=exc)
        except BaseException as exc:
            self.queue.release(job.job_id, owner)
            log.warning("job %s interrupted (%s); back to pending", short, type(exc).__name__)
            raise
        else:
            self._complete(job, owner, memory_id, t0)
        finally:
            beating.set()
            self._current = None
            self._notify()

    def _heartbeat(self, job_ids: list[str], owner: str, stop: threading.Event) -> None:
        """Beat for each job still held; stop once none is (all finished or taken away)."""
        held = list(job_ids)
        while held and not stop.wait(self.queue.lease / 4):
            try:
                held = [j for j in held if self.queue.heartbeat(j, owner)]
            except LearnerError:
                return
