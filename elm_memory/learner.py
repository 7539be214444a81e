"""Memory learner: learn memories on or off the request path, from a durable job queue.

After ELM answers a question it *submits* the question here; learning a memory from it
(minutes of GRPO on a CPU) is the learner's job, not the request's. Three modes, chosen
by ``LearnerConfig.mode`` and built by :func:`build_learner`:

``sync``
    :meth:`SyncLearner.submit` runs the learning inline and returns when the memory is
    stored: the paper's strict online protocol (memory *i* exists before question *i+1*
    is answered). The job is still recorded in the queue first, so a crash mid-learning
    is resumed by the next learner that opens the queue.
``background``
    :meth:`BackgroundLearner.submit` only records the job (one SQLite transaction, a few
    milliseconds) and wakes a daemon worker thread; it never waits for learning.
``off``
    :class:`NoLearner`: nothing is learned or recorded.

The learning itself is an injected callable ``learn_fn(job) -> memory_id | None``; this
module knows nothing about torch, models or stores.

Batches. With ``batch_size > 1`` and a ``learn_many_fn(jobs) -> [memory_id | None |
Exception, ...]`` (one entry per job, in order), a worker claims up to ``batch_size``
pending jobs at once and learns them in one call (several memories trained together).
Each job keeps its own ledger row (claim, heartbeat, complete, fail). The batch is only an
optimisation: if ``learn_many_fn`` raises, or returns an Exception for a job, that job is
run again alone with ``learn_fn`` within the same attempt, and that run's outcome is what
is recorded, so one bad job fails alone and never takes its batch-mates with it.

Durability. Jobs live in one SQLite file (WAL; committed before ``submit`` returns), by convention
``<store path>/learner.sqlite3``. A job moves ``pending -> running -> done | failed``.
Claiming is an atomic transaction, so several workers (threads or processes) can drain
the same queue. A job left ``running`` by a worker that is gone (its process is dead,
its thread in this process has exited, or, for a worker on another host, its heartbeat
is older than the queue's ``lease``) goes back to ``pending`` when any learner opens
the queue (and periodically while a background worker idles): that is the
crash-resume path. ``attempts`` counts claims; an attempt that raises, or whose process
dies, counts as failed, and after ``max_attempts`` the job becomes ``failed`` with the
last error kept. An interrupt (``KeyboardInterrupt``, ``SystemExit``) in ``learn_fn``
does not count: the job goes back to ``pending`` untouched.

Idempotency contract ("every memory stored once")
-------------------------------------------------
* **Job identity.** ``job_id = sha256("elm-learn-v1", scope, namespace,
  sha256(question.strip()))`` (see :func:`make_job_id`; the inner hash is
  :func:`elm_memory.memory.question_hash`). Submitting the same question in the same
  namespace (and scope) again returns the existing job instead of queueing a new one:
  ``pending``/``running`` -> the same job, not queued twice; ``done`` -> never rerun,
  the ticket carries the ``memory_id`` it produced; ``failed`` -> re-queued with fresh
  attempts (an explicit resubmission is the retry button). ``config_overrides`` are
  *not* part of the identity: a duplicate's overrides are ignored. ``scope`` should name
  what a memory is specific to (e.g. the model fingerprint), so switching models does
  not make the new model's memories look already learned.
* **Queue guarantee.** At most one worker holds a job at a time, and a ``done`` job is
  never claimed again: at most one *recorded* successful run per ``job_id``. A
  ``running`` job is only reclaimed once its owner is dead (same host: by pid; another
  host: heartbeat older than ``lease``, default 10 min, so a worker on another host that
  is alive but cannot heartbeat for that long may see its job rerun).
* **The boundary.** ``learn_fn``'s store write and the queue's ``done`` commit are two
  systems: a crash after the store write but before the commit reruns the job on
  restart. ``learn_fn`` must therefore make its write idempotent on ``job.job_id``.
  Recommended: use ``job.job_id`` as the memory id (``memory.meta.id = job.job_id``
  before ``store.put``); the store upserts by id, so a rerun overwrites the same memory
  instead of adding a second one. Return that id; the queue records it as ``memory_id``.

Limits: ``learn_fn`` is not time-limited (a thread cannot be killed); a hung job holds
the single worker. Done rows are kept forever (they *are* the idempotency record).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from elm_memory.errors import ConfigError, ELMError, InvalidQuestionError

log = logging.getLogger("elm_memory.learner")

JobState = Literal["pending", "running", "done", "failed"]
TicketStatus = Literal["pending", "running", "done", "failed", "skipped"]
STATES: tuple[JobState, ...] = ("pending", "running", "done", "failed")
TERMINAL = frozenset({"done", "failed"})
LearnFn = Callable[["LearnJob"], "str | None"]
LearnManyFn = Callable[[list["LearnJob"]], "list[str | None | Exception]"]

QUEUE_FILENAME = "learner.sqlite3"
SCHEMA_VERSION = 1
_ID_PREFIX = "elm-learn-v1"


class LearnerError(ELMError):
    """The learner is closed, its queue file is unusable, or a job id is unknown."""


# ---- jobs -----------------------------------------------------------------------------


def question_hash(question: str) -> str:
    """Same as :func:`elm_memory.memory.question_hash` (not imported: that module needs torch)."""
    return hashlib.sha256(question.strip().encode("utf-8")).hexdigest()


def make_job_id(question: str, namespace: str, scope: str = "") -> str:
    """Deterministic job id: same (scope, namespace, stripped question) -> same id."""
    payload = "\x00".join((_ID_PREFIX, scope, namespace, question_hash(question)))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def default_queue_path(store_path: str | os.PathLike[str]) -> Path:
    """Where the queue lives for a store folder: ``<store path>/learner.sqlite3``."""
    return Path(store_path).expanduser() / QUEUE_FILENAME


@dataclass(frozen=True)
class LearnJob:
    """One question to learn a memory from: what ``learn_fn`` receives.

    ``attempts`` is the number of this run (1 for the first) when handed to ``learn_fn``.
    """

    job_id: str
    question: str
    namespace: str
    submitted_at: float
    attempts: int = 0
    config_overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def create(
        cls,
        question: str,
        namespace: str = "default",
        *,
        scope: str = "",
        config_overrides: dict[str, Any] | None = None,
    ) -> LearnJob:
        if not isinstance(question, str) or not question.strip():
            raise InvalidQuestionError("a learn job needs a non-empty question string")
        if not isinstance(namespace, str) or not namespace:
            raise LearnerError("a learn job needs a non-empty namespace string")
        overrides = _json_copy(config_overrides or {})
        if not isinstance(overrides, dict):
            raise LearnerError("config_overrides must be a mapping")
        return cls(
            job_id=make_job_id(question, namespace, scope),
            question=question,
            namespace=namespace,
            submitted_at=time.time(),
            config_overrides=overrides,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LearnJob:
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> LearnJob:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class JobRecord:
    """A job and where it stands in the queue."""

    job: LearnJob
    state: JobState
    memory_id: str | None = None
    error: str | None = None  # last failed attempt's error (kept while retrying)
    owner: str | None = None  # who runs it (host|pid|start|token) while running
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LearnTicket:
    """What ``submit`` returns: the job id and its status at return time."""

    job_id: str
    status: TicketStatus
    memory_id: str | None = None
    error: str | None = None
    attempts: int = 0
    duplicate: bool = False  # the job already existed (nothing new was queued)

    @property
    def done(self) -> bool:
        return self.status == "done"

    @classmethod
    def from_record(cls, rec: JobRecord, *, duplicate: bool = False) -> LearnTicket:
        return cls(rec.job_id, rec.state, rec.memory_id, rec.error, rec.job.attempts, duplicate)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json_copy(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise LearnerError(f"config_overrides must be JSON-serialisable: {exc}") from None


# ---- worker identity: who holds a running job, and is it still alive? -----------------

_HOST = socket.gethostname()
_LIVE: set[str] = set()  # owner tokens of live workers in this process
_LIVE_LOCK = threading.Lock()


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) from /proc, or None where there is no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _new_owner() -> str:
    stat = _proc_stat(os.getpid())
    return f"{_HOST}|{os.getpid()}|{stat[1] if stat else ''}|{uuid.uuid4().hex[:12]}"


def _register(owner: str) -> None:
    with _LIVE_LOCK:
        _LIVE.add(owner)


def _unregister(owner: str) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(owner)


def owner_is_alive(owner: str | None) -> bool | None:
    """Is the worker that holds a running job still there?

    False when provably gone: its process died (or its pid now belongs to another
    process), or it was a worker of *this* process that has exited. None for owners on
    another host (pids mean nothing here): the queue then judges by heartbeat age."""
    if not owner:
        return False
    try:
        host, pid_text, start, _token = owner.rsplit("|", 3)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != _HOST:
        return None
    if pid == os.getpid():
        with _LIVE_LOCK:
            return owner in _LIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return True
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    if state in ("Z", "X"):  # exited, not yet reaped
        return False
    return not (start and started != start)


# ---- the durable queue ----------------------------------------------------------------

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
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
"""


class JobQueue:
    """Durable FIFO of :class:`LearnJob` rows in one SQLite file (WAL mode).

    A running job's owner heartbeats every ``lease / 4`` s (see :class:`_QueueLearner`);
    owners on other hosts are presumed dead once their heartbeat is ``lease`` s old.

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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                str(self.path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                log.warning("learner queue %s is not in WAL mode", self.path)
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.close()
                raise LearnerError(
                    f"learner queue {self.path} has format {version}; this elm-memory reads {SCHEMA_VERSION}"
                )
            conn.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version = {SCHEMA_VERSION};COMMIT;")
        except sqlite3.Error as exc:
            with contextlib.suppress(NameError, sqlite3.Error):
                conn.close()
            raise LearnerError(f"cannot open learner queue {self.path}: {exc}") from None
        except OSError as exc:
            raise LearnerError(f"cannot create learner queue folder {self.path.parent}: {exc}") from None
        self._conn: sqlite3.Connection | None = conn

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
                    " started_at = NULL, finished_at = NULL WHERE job_id = ? AND state = 'failed'",
                    (job.job_id,),
                ).rowcount
                if n:
                    log.info("job %s had failed; resubmitted, queued again", job.job_id[:12])
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job.job_id,)).fetchone()
        return self._record(row), created

    def claim(self, owner: str, job_id: str | None = None) -> JobRecord | None:
        """Atomically move the oldest pending job (or ``job_id`` if pending) to ``running``."""
        where, args = ("state = 'pending'", ()) if job_id is None else ("state = 'pending' AND job_id = ?", (job_id,))
        with self._db() as conn:  # cheap read first: no write lock while the queue is idle
            if conn.execute(f"SELECT 1 FROM jobs WHERE {where} LIMIT 1", args).fetchone() is None:
                return None
        with self._tx() as conn:
            row = conn.execute(f"SELECT seq FROM jobs WHERE {where} ORDER BY seq LIMIT 1", args).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE jobs SET state = 'running', attempts = attempts + 1, owner = ?, started_at = ?,"
                " heartbeat_at = ?, finished_at = NULL WHERE seq = ?",
                (owner, now := time.time(), now, row["seq"]),
            )
            row = conn.execute("SELECT * FROM jobs WHERE seq = ?", (row["seq"],)).fetchone()
        return self._record(row)

    def claim_many(self, owner: str, limit: int) -> list[JobRecord]:
        """Atomically move the ``limit`` oldest pending jobs (or fewer) to ``running``, in order."""
        if limit <= 1:
            rec = self.claim(owner)
            return [] if rec is None else [rec]
        with self._db() as conn:  # cheap read first: no write lock while the queue is idle
            if conn.execute("SELECT 1 FROM jobs WHERE state = 'pending' LIMIT 1").fetchone() is None:
                return []
        with self._tx() as conn:
            seqs = [r["seq"] for r in conn.execute(
                "SELECT seq FROM jobs WHERE state = 'pending' ORDER BY seq LIMIT ?", (int(limit),)
            ).fetchall()]  # fmt: skip
            now = time.time()
            rows = []
            for seq in seqs:
                conn.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, owner = ?, started_at = ?,"
                    " heartbeat_at = ?, finished_at = NULL WHERE seq = ?",
                    (owner, now, now, seq),
                )
                rows.append(conn.execute("SELECT * FROM jobs WHERE seq = ?", (seq,)).fetchone())
        return [self._record(r) for r in rows]

    def complete(self, job_id: str, owner: str, memory_id: str | None) -> bool:
        """``running -> done``; False if ``owner`` no longer holds the job."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET state = 'done', memory_id = ?, error = NULL, finished_at = ?, owner = NULL"
                " WHERE job_id = ? AND state = 'running' AND owner = ?",
                (memory_id, time.time(), job_id, owner),
            ).rowcount
        return n == 1

    def fail(self, job_id: str, owner: str, error: str) -> JobRecord | None:
        """Record a failed attempt: back to ``pending``, or ``failed`` after ``max_attempts``.

        None if ``owner`` no longer holds the job."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET error = ?, owner = NULL,"
                " state = CASE WHEN attempts >= ? THEN 'failed' ELSE 'pending' END,"
                " finished_at = CASE WHEN attempts >= ? THEN ? ELSE NULL END"
                " WHERE job_id = ? AND state = 'running' AND owner = ?",
                (error, self.max_attempts, self.max_attempts, time.time(), job_id, owner),
            ).rowcount
            row = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._record(row) if n == 1 else None

    def release(self, job_id: str, owner: str) -> bool:
        """``running -> pending`` without counting the attempt (the run was interrupted)."""
        with self._tx() as conn:
            n = conn.execute(
                "UPDATE jobs SET state = 'pending', attempts = MAX(attempts - 1, 0), owner = NULL,"
                " started_at = NULL WHERE job_id = ? AND state = 'running' AND owner = ?",
                (job_id, owner),
            ).rowcount
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
                "SELECT job_id, owner, COALESCE(heartbeat_at, started_at, 0) AS beat FROM jobs"
                " WHERE state = 'running'"
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
        sql, args = "SELECT * FROM jobs", []
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
        out = dict.fromkeys(STATES, 0)
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


# ---- learners -------------------------------------------------------------------------


@runtime_checkable
class MemoryLearner(Protocol):
    """Accepts questions to learn memories from; see the module docstring for the contract."""

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

    def __exit__(self, *exc: object) -> None: ...


class _QueueLearner:
    """Shared parts of the queue-backed learners: the queue, running one job, waiting."""

    mode = "?"

    def __init__(
        self,
        learn_fn: LearnFn,
        queue: JobQueue | str | os.PathLike[str],
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

    def __enter__(self) -> _QueueLearner:
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
            try:
                results: list[Any] | None = list(self.learn_many_fn(jobs))
                if len(results) != len(jobs):
                    log.warning("learn_many_fn returned %d results for %d jobs; running them alone",
                                len(results), len(jobs))  # fmt: skip
                    results = None
            except Exception as exc:
                log.warning("batch of %d jobs failed (%s: %s); running them one at a time",
                            len(jobs), type(exc).__name__, exc)  # fmt: skip
                results = None
            except BaseException:
                self._release(recs, owner)
                log.warning("batch of %d jobs interrupted; back to pending", len(jobs))
                raise
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
            error = f"{type(exc).__name__}: {exc}"
            error = error if len(error) <= 2000 else error[:2000] + " [...]"
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


class SyncLearner(_QueueLearner):
    """Learns inline: ``submit`` returns when the job is done or failed (retries included).

    The queue is drained in FIFO order on the caller's thread, one job (or one batch, see
    ``batch_size``) at a time (a lock serialises concurrent callers), so jobs left pending
    by a crash run before the new one.
    """

    mode = "sync"

    def __init__(self, learn_fn: LearnFn, queue: JobQueue | str | os.PathLike[str], **kwargs: Any):
        super().__init__(learn_fn, queue, **kwargs)
        self.owner = _new_owner()
        _register(self.owner)
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
        return LearnTicket.from_record(self.queue.get(rec.job_id) or rec, duplicate=not created)

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
            _unregister(self.owner)
            self.queue.close()


class BackgroundLearner(_QueueLearner):
    """One daemon worker thread drains the durable queue; ``submit`` returns at once.

    The worker resumes pending (and recovered) jobs when it starts, sleeps on a condition
    variable (woken by ``submit``; polls every ``poll_interval`` s for jobs added by other
    processes), and survives ``learn_fn`` exceptions (a failed attempt). If it is stopped
    by an interrupt, the next ``submit``/``wait`` restarts it.
    """

    mode = "background"

    def __init__(
        self, learn_fn: LearnFn, queue: JobQueue | str | os.PathLike[str], *, start: bool = True, **kwargs: Any
    ):
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
        return LearnTicket.from_record(rec, duplicate=not created)

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
        owner = _new_owner()
        _register(owner)
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
            _unregister(owner)
            self._notify()
            with self._cv:
                closed = self._closed
            if closed:
                self.queue.close()


class NoLearner:
    """``mode: off``: nothing is learned, nothing is recorded."""

    mode = "off"

    def __init__(self, *, scope: str = ""):
        self.scope = scope

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


def build_learner(
    mode: str,
    learn_fn: LearnFn | None,
    queue_path: str | os.PathLike[str] | None,
    *,
    scope: str = "",
    max_attempts: int = 3,
    poll_interval: float = 1.0,
    batch_size: int = 1,
    learn_many_fn: LearnManyFn | None = None,
) -> MemoryLearner:
    """The learner for ``LearnerConfig.mode``. ``queue_path`` is the SQLite file (see
    :func:`default_queue_path`); ``scope`` is mixed into job ids (use the model fingerprint);
    ``batch_size`` jobs at most are learned together by ``learn_many_fn`` (see the module docstring)."""
    if mode == "off":
        return NoLearner(scope=scope)
    if mode not in ("sync", "background"):
        raise ConfigError(f"unknown learner mode {mode!r}; one of sync, background, off")
    if learn_fn is None or queue_path is None:
        raise ConfigError(f"learner mode {mode!r} needs a learn_fn and a queue path")
    cls = SyncLearner if mode == "sync" else BackgroundLearner
    return cls(
        learn_fn, queue_path, scope=scope, max_attempts=max_attempts, poll_interval=poll_interval,
        batch_size=batch_size, learn_many_fn=learn_many_fn,
    )  # fmt: skip
