"""``learner.mode: sync``: learn inline, so memory *i* exists before question *i+1* is answered.

The paper's strict online protocol. The job is still recorded in the queue first, so a crash
mid-learning is resumed by the next learner that opens the queue.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from elm_memory.jobs.learner import LearnFn, QueueLike
from elm_memory.jobs.owners import LIVE_OWNERS, new_owner
from elm_memory.jobs.queue_learner import QueueLearner
from elm_memory.jobs.records import LearnTicket

log = logging.getLogger("elm_memory.jobs")


class SyncLearner(QueueLearner):
    """Learns inline: ``submit`` returns when the job is done or failed (retries included).

    The queue is drained in FIFO order on the caller's thread, one job (or one batch, see
    ``batch_size``) at a time (a lock serialises concurrent callers), so jobs left pending
    by a crash run before the new one.
    """

    mode = "sync"

    def __init__(self, learn_fn: LearnFn, queue: QueueLike, **kwargs: Any):
        super().__init__(learn_fn, queue, **kwargs)
        self.owner = new_owner()
        LIVE_OWNERS.add(self.owner)
        self._run_lock = threading.RLock()
        self.queue.recover()
        pending = self.queue.counts()["pending"]
        if pending:
            log.info("%d learn jobs pending in %s; they run before the next submitted one", pending, self.queue.path)

    def submit(
        self, question: str, namespace: str = "default", *, config_overrides: dict[str, Any] | None = None
    ) -> LearnTicket:
        self._check_open()
        rec, created = self.queue.add(self._make_job(question, namespace, config_overrides))
        if rec.state != "done":
            self._drain(rec.job_id, None)
        return self._ticket(self.queue.get(rec.job_id) or rec, created)

    def wait(self, job_id: str | None = None, timeout: float | None = None) -> bool:
        """Run pending jobs here (the resume path), until ``job_id`` or all are settled."""
        if self._closed:
            return self._settled(job_id)
        return self._drain(job_id, None if timeout is None else time.monotonic() + timeout)

    def _drain(self, until: str | None, deadline: float | None) -> bool:
        while True:
            if self._settled(until):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            with self._cv:
                gen = self._gen
            with self._run_lock:
                recs = self._claim(self.owner)
                if recs:
                    self._run_batch(recs, self.owner)
                    continue
            # Nothing we can run: the job is held by another worker. Wait for it.
            self.queue.recover()
            wait = self.poll_interval if deadline is None else min(self.poll_interval, deadline - time.monotonic())
            with self._cv:
                if self._gen == gen and wait > 0:
                    self._cv.wait(wait)

    def _worker_alive(self) -> bool:
        return not self._closed

    def close(self, wait: bool = True) -> None:
        """``wait``: first run the pending jobs (if any were left by a crash)."""
        if self._closed:
            return
        with self._run_lock:
            while wait and (recs := self._claim(self.owner)):
                self._run_batch(recs, self.owner)
            self._closed = True
            LIVE_OWNERS.discard(self.owner)
            self.queue.close()
