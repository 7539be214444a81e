"""``learner.mode: background``: a daemon worker thread learns; answers never wait for it.

``submit`` only records the job (one SQLite transaction, a few milliseconds) and wakes the
worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from elm_memory.jobs.learner import LearnFn, QueueLike
from elm_memory.jobs.owners import LIVE_OWNERS, new_owner
from elm_memory.jobs.queue_learner import QueueLearner
from elm_memory.jobs.records import LearnerError, LearnTicket

log = logging.getLogger("elm_memory.jobs")


class BackgroundLearner(QueueLearner):
    """One daemon worker thread drains the durable queue; ``submit`` returns at once.

    The worker resumes pending (and recovered) jobs when it starts, sleeps on a condition
    variable (woken by ``submit``; polls every ``poll_interval`` s for jobs added by other
    processes), and survives ``learn_fn`` exceptions (a failed attempt). If it is stopped
    by an interrupt, the next ``submit``/``wait`` restarts it.
    """

    mode = "background"

    def __init__(self, learn_fn: LearnFn, queue: QueueLike, *, start: bool = True, **kwargs: Any):
        super().__init__(learn_fn, queue, **kwargs)
        self._thread: threading.Thread | None = None
        self.owner: str | None = None  # the current worker thread's owner token
        self._stop = False
        self._drain_on_stop = False
        self._wake = False
        if start:
            self.start()

    def start(self) -> None:
        with self._cv:
            self._check_open()
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._worker, name="elm-memory-learner", daemon=True)
            self._thread.start()

    def submit(
        self, question: str, namespace: str = "default", *, config_overrides: dict[str, Any] | None = None
    ) -> LearnTicket:
        """Record the job durably and wake the worker; never waits for learning."""
        self._check_open()
        rec, created = self.queue.add(self._make_job(question, namespace, config_overrides))
        if rec.state == "pending":
            self._ensure_worker()
            with self._cv:
                self._wake = True
                self._cv.notify_all()
        log.debug("submitted job %s (%s)", rec.job_id[:12], "new" if created else f"already {rec.state}")
        return self._ticket(rec, created)

    def wait(self, job_id: str | None = None, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                gen = self._gen
            if self._settled(job_id):
                return True
            if not self._worker_alive():
                if self._closed:
                    return False  # nobody here will make progress
                self._ensure_worker()
            wait = self.poll_interval if deadline is None else min(self.poll_interval, deadline - time.monotonic())
            if wait <= 0:
                return False
            with self._cv:
                if self._gen == gen:
                    self._cv.wait(wait)

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop the worker. ``wait=True``: drain the queue first (like an executor's shutdown).
        ``wait=False``: return now; the job in progress finishes in the daemon thread if the
        process lives on (else it is resumed next time); pending jobs stay queued."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._drain_on_stop = wait
            self._wake = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread.is_alive():
            if not wait:
                return  # the worker closes the queue when it exits
            thread.join(timeout)
            if thread.is_alive():
                with self._cv:
                    self._drain_on_stop = False
                log.warning("learner worker still busy after %.1fs; it stops after the current job", timeout or 0)
                return
        self.queue.close()

    def _ensure_worker(self) -> None:
        if not self._closed and not self._worker_alive():
            if self._thread is not None:
                log.warning("learner worker had stopped; restarting it")
            self.start()

    def _worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _worker(self) -> None:
        owner = new_owner()
        LIVE_OWNERS.add(owner)
        self.owner = owner
        try:
            n = self.queue.recover()
            if n:
                log.info("resumed %d learn jobs left running by a dead worker", n)
            while True:
                with self._cv:
                    if self._stop and not self._drain_on_stop:
                        break
                try:
                    recs = self._claim(owner)
                except LearnerError:
                    log.exception("learner worker cannot claim a job; retrying in %.1fs", self.poll_interval)
                    recs = []
                if recs:
                    try:
                        self._run_batch(recs, owner)
                    except LearnerError:  # the queue failed while recording an outcome
                        log.exception("learner worker could not record jobs %s", ", ".join(r.job_id[:12] for r in recs))
                    continue
                with self._cv:
                    if self._stop:
                        break  # drained
                    if not self._wake:
                        self._cv.wait(self.poll_interval)
                    woken, self._wake = self._wake, False
                if not woken:
                    with contextlib.suppress(LearnerError):
                        self.queue.recover()
        except BaseException as exc:  # an interrupt inside learn_fn (the job was released)
            log.error("learner worker stopped by %s; queued jobs are kept", type(exc).__name__)
        finally:
            LIVE_OWNERS.discard(owner)
            self._notify()
            with self._cv:
                closed = self._closed
            if closed:
                self.queue.close()
