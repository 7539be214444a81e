"""The durable job queue: learn jobs as rows of one SQLite file, shared by every worker.

Durability. Jobs live in one SQLite file (WAL; committed before ``submit`` returns), by
convention ``<store path>/learner.sqlite3``. A job moves ``pending -> running -> done |
failed``. Claiming is an atomic transaction, so several workers (threads or processes) can
drain the same queue. One host only: SQLite's WAL mode needs every process that opens the
file on the machine that holds it (shared memory; network filesystems are not safe), so the
file is never shared between hosts. Learning on other machines goes through a process of this
host that owns the file (``learner.mode: ray``: :mod:`elm_memory.jobs.ray_dispatch`). A job left
``running`` by a worker that is gone (its process is dead, or its thread in this process has
exited) goes back to ``pending`` when any learner opens the queue (and periodically while a
background worker idles): that is the crash-resume path. A failed attempt may set a
``not_before`` time (retry backoff): the job is not claimed before it.
``attempts`` counts claims; an attempt that raises, or whose process dies, counts as
failed, and after ``max_attempts`` the job becomes ``failed`` with the last error kept. An
interrupt (``KeyboardInterrupt``, ``SystemExit``) in ``learn_fn`` does not count: the job
goes back to ``pending`` untouched.

Done rows are kept forever: they *are* the idempotency record (see :mod:`elm_memory.jobs`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from elm_memory.errors import ConfigError
from elm_memory.faults import point
from elm_memory.jobs.owners import owner_is_alive
from elm_memory.jobs.records import STATES, JobRecord, JobState, LearnerError, LearnJob

log = logging.getLogger("elm_memory.jobs")

SCHEMA_VERSION = 2  # 2: not_before (retry backoff), added in place to version-1 files
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    question TEXT NOT NULL,
    namespace TEXT NOT NULL,
    config_overrides TEXT NOT NULL DEFAULT '{}',
    state TEXT NOT NULL CHECK (state IN ('pending', 'running', 'done', 'failed')),
    attempts INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    heartbeat_at REAL,
    finished_at REAL,
    owner TEXT,
    memory_id TEXT,
    error TEXT,
    not_before REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
"""


def _connect(path: Path, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """Open (creating if needed) the queue file at the current schema version."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LearnerError(f"cannot create learner queue folder {path.parent}: {exc}") from None
    conn = None
    try:
        # autocommit (isolation_level=None): every state change is an explicit BEGIN IMMEDIATE
        conn = sqlite3.connect(str(path), timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            log.warning("learner queue %s is not in WAL mode", path)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise LearnerError(f"learner queue {path} has format {version}; this elm-memory reads {SCHEMA_VERSION}")
        conn.execute("BEGIN IMMEDIATE")
        columns = {r[1] for r in conn.execute("PRAGMA table_info(jobs)").fetchall()}
        if columns and "not_before" not in columns:  # a version-1 file: add the column in place
            conn.execute("ALTER TABLE jobs ADD COLUMN not_before REAL")
        conn.execute("COMMIT")
        conn.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version = {SCHEMA_VERSION};COMMIT;")
    except (sqlite3.Error, LearnerError) as exc:
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        if isinstance(exc, LearnerError):
            raise
        raise LearnerError(f"cannot open learner queue {path}: {exc}") from None
    return conn


class JobQueue:
    """Durable FIFO of :class:`LearnJob` rows in one SQLite file (WAL mode).

    A running job's owner heartbeats every ``lease / 4`` s (see
    :class:`~elm_memory.jobs.learner.QueueLearner`). Every process that opens the file must run
    on its host (WAL); an owner token naming another host (a file copied or restored elsewhere)
    is presumed dead once its heartbeat is ``lease`` s old.

    ``synchronous="NORMAL"`` (default): a committed job survives any crash of the
    process, without an fsync on the request path (a few ms saved per submit; measured
    median ~4 ms, max ~25 ms with FULL on ext4). ``"FULL"`` also survives power loss.

    Thread-safe (one connection behind a lock; every statement is short) and safe across
    processes (state changes are ``BEGIN IMMEDIATE`` transactions).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_attempts: int = 3,
        busy_timeout: float = 30.0,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        lease: float = 600.0,
    ):
        if max_attempts < 1:
            raise ConfigError("learner max_attempts must be >= 1")
        if synchronous not in ("NORMAL", "FULL"):
            raise ConfigError("learner queue synchronous must be NORMAL or FULL")
        self.path = Path(path).expanduser()
        self.max_attempts = max_attempts
        self.lease = lease
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = _connect(self.path, busy_timeout, synchronous)

    # -- plumbing ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                raise LearnerError(f"learner queue {self.path} is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise LearnerError(f"learner queue {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._db() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @staticmethod
    def _record(row: sqlite3.Row) -> JobRecord:
        job = LearnJob(
            job_id=row["job_id"],
            question=row["question"],
            namespace=row["namespace"],
            submitted_at=row["submitted_at"],
            attempts=row["attempts"],
            config_overrides=json.loads(row["config_overrides"] or "{}"),
        )
        return JobRecord(
            job=job,
            state=row["state"],
            memory_id=row["memory_id"],
            error=row["error"],
            owner=row["owner"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
        )

    # -- writes ------------------------------------------------------------------------
    def add(self, job: LearnJob, *, requeue_failed: bool = True) -> tuple[JobRecord, bool]:
        """Insert ``job`` unless its id exists. Returns (the row, whether it was inserted).

        An existing ``failed`` job is put back to ``pending`` with fresh attempts when
        ``requeue_failed``; any other existing job is returned unchanged.
        """
        with self._tx() as conn:
            cur = conn.execute(
                "INSERT OR IGNORE INTO jobs (job_id, question, namespace, config_overrides, state, attempts,"
                " submitted_at) VALUES (?, ?, ?, ?, 'pending', 0, ?)",
                (job.job_id, job.question, job.namespace, json.dumps(job.config_overrides), job.submitted_at),
            )
            created = cur.rowcount == 1
            if not created and requeue_failed:
                n = conn.execute(
                    "UPDATE jobs SET state = 'pending', attempts = 0, error = NULL, owner = NULL,"
                    " started_at = NULL, finished_at = NULL, not_before = NULL WHERE job_id = ? AND state = 'failed'",
                    (job.job_id,),
                ).rowcount
                if n:
                    log.info("job %s had failed; resubmitted, queued again", job.job_id[:12])
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job.job_id,)).fetchone()
        point("job.added")
        return self._record(row), created

    def claim(self, owner: str, job_id: str | None = None) -> JobRecord | None:
        """Atomically move the oldest pending job (or ``job_id`` if pending) to ``running``."""
        if job_id is None:
            recs = self._take(owner, "state = 'pending'", (), 1)
        else:
            recs = self._take(owner, "state = 'pending' AND job_id = ?", (job_id,), 1)
        return recs[0] if recs else None

    def claim_many(self, owner: str, limit: int) -> list[JobRecord]:
        """Atomically move the ``limit`` oldest pending jobs (or fewer) to ``running``, in order."""
        return self._take(owner, "state = 'pending'", (), max(1, int(limit)))

    def _take(self, owner: str, where: str, args: Sequence[str | float], limit: int) -> list[JobRecord]:
        """Claim up to ``limit`` of the oldest rows matching ``where`` for ``owner``, in one transaction
        (never a job whose retry backoff, ``not_before``, is still ahead)."""
        where = f"{where} AND (not_before IS NULL OR not_before <= ?)"
        args = (*args, time.time())
        with self._db() as conn:  # cheap read first: no write lock while the queue is idle
            if conn.execute(f"SELECT 1 FROM jobs WHERE {where} LIMIT 1", args).fetchone() is None:
                return []
        with self._tx() as conn:
            found = conn.execute(f"SELECT seq FROM jobs WHERE {where} ORDER BY seq LIMIT ?", (*args, limit))
            seqs = [r["seq"] for r in found.fetchall()]
            now = time.time()
            rows = []
            for seq in seqs:
                conn.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, owner = ?, started_at = ?,"
                    " heartbeat_at = ?, finished_at = NULL, not_before = NULL WHERE seq = ?",
                    (owner, now, now, seq),
                )
                rows.append(conn.execute("SELECT * FROM jobs WHERE seq = ?", (seq,)).fetchone())
        if rows:
            point("job.claimed")
        return [self._record(r) for r in rows]

    def complete(self, job_id: str, owner: str, memory_id: str | None) -> bool:
        """``running -> done``; False if ``owner`` no longer holds the job."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET state = 'done', memory_id = ?, error = NULL, finished_at = ?, owner = NULL"
                " WHERE job_id = ? AND state = 'running' AND owner = ?",
                (memory_id, time.time(), job_id, owner),
            ).rowcount
        point("job.completed")
        return n == 1

    def fail(self, job_id: str, owner: str, error: str, *, retry_in: float = 0.0) -> JobRecord | None:
        """Record a failed attempt: back to ``pending`` (claimable again ``retry_in`` s from now),
        or ``failed`` after ``max_attempts``.

        None if ``owner`` no longer holds the job."""
        now = time.time()
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET error = ?, owner = NULL,"
                " state = CASE WHEN attempts >= ? THEN 'failed' ELSE 'pending' END,"
                " finished_at = CASE WHEN attempts >= ? THEN ? ELSE NULL END,"
                " not_before = CASE WHEN attempts >= ? OR ? <= 0 THEN NULL ELSE ? END"
                " WHERE job_id = ? AND state = 'running' AND owner = ?",
                (
                    error,
                    self.max_attempts,
                    self.max_attempts,
                    now,
                    self.max_attempts,
                    retry_in,
                    now + retry_in,
                    job_id,
                    owner,
                ),
            ).rowcount
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        point("job.failed")
        return self._record(row) if n == 1 else None

    def release(self, job_id: str, owner: str) -> bool:
        """``running -> pending`` without counting the attempt (the run was interrupted)."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET state = 'pending', attempts = MAX(attempts - 1, 0), owner = NULL,"
                " started_at = NULL WHERE job_id = ? AND state = 'running' AND owner = ?",
                (job_id, owner),
            ).rowcount
        point("job.released")
        return n == 1

    def forget(self, job_id: str) -> bool:
        """Delete a job that is not running, whatever its state; False when there is none (or it runs).

        For a caller that rolls its own state back past the job: a resumed evaluation drops the
        jobs of questions it never recorded, so submitting such a question again learns it anew."""
        with self._tx() as conn:
            n = conn.execute("DELETE FROM jobs WHERE job_id = ? AND state != 'running'", (job_id,)).rowcount
        return n == 1

    def heartbeat(self, job_id: str, owner: str) -> bool:
        """Record that ``owner`` is still working on ``job_id``; False if it no longer holds it."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET heartbeat_at = ? WHERE job_id = ? AND state = 'running' AND owner = ?",
                (time.time(), job_id, owner),
            ).rowcount
        return n == 1

    def recover(self, is_alive: Callable[[str | None], bool | None] = owner_is_alive) -> int:
        """Put ``running`` jobs whose owner is gone back to ``pending`` (or ``failed``, when the
        lost attempt was the last one). Returns how many jobs were recovered.

        An owner is gone when ``is_alive`` says False; when it cannot tell (None: another
        host), when its last heartbeat is older than ``lease`` seconds."""
        now = time.time()
        with self._db() as conn:
            running = conn.execute(
                "SELECT job_id, owner, COALESCE(heartbeat_at, started_at, 0) AS beat FROM jobs WHERE state = 'running'"
            ).fetchall()
        stale = []
        for r in running:
            alive = is_alive(r["owner"])
            if alive is None:
                alive = now - r["beat"] <= self.lease
            if not alive:
                stale.append((r["job_id"], r["owner"]))
        if not stale:
            return 0
        recovered = 0
        with self._tx() as conn:
            for job_id, owner in stale:
                row = conn.execute(
                    "SELECT * FROM jobs WHERE job_id = ? AND state = 'running' AND owner IS ?", (job_id, owner)
                ).fetchone()
                if row is None:  # finished or recovered by someone else meanwhile
                    continue
                last = row["attempts"] >= self.max_attempts
                error = f"worker {owner} died during attempt {row['attempts']}"
                conn.execute(
                    "UPDATE jobs SET state = ?, error = ?, owner = NULL, finished_at = ? WHERE seq = ?",
                    ("failed" if last else "pending", error, now if last else None, row["seq"]),
                )
                recovered += 1
                if last:
                    log.error("job %s failed: %s (max_attempts=%d reached)", job_id[:12], error, self.max_attempts)
                else:
                    log.warning("job %s resumed: %s; back to pending", job_id[:12], error)
        point("job.recovered")
        return recovered

    # -- reads -------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord | None:
        with self._db() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._record(row) if row is not None else None

    def list(self, state: JobState | None = None, limit: int | None = None) -> list[JobRecord]:
        """Jobs in submission order, optionally of one state."""
        if state is not None and state not in STATES:
            raise LearnerError(f"unknown job state {state!r}; one of {', '.join(STATES)}")
        sql = "SELECT * FROM jobs"
        args: list[str | int] = []
        if state is not None:
            sql += " WHERE state = ?"
            args.append(state)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        with self._db() as conn:
            rows = conn.execute(sql, args).fetchall()
        return [self._record(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._db() as conn:
            rows = conn.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state").fetchall()
        out: dict[str, int] = dict.fromkeys(STATES, 0)
        out.update({r["state"]: r["n"] for r in rows})
        return out

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._conn is None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> JobQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
