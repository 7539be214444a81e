"""Per-memory utility counters and the delete journal: ``<store>/utility.sqlite3``.

Why a side table and not Chroma metadata: a Chroma metadata update is a read-modify-write
(get the row, add one, write it back), so two concurrent answers can both read 3 and both
write 4. Here every change is one ``INSERT ... ON CONFLICT DO UPDATE SET n = n + ?``
statement, which SQLite applies under its write lock: exact for any number of threads
(one connection behind a lock) and of processes on one host (SQLite's file locks, WAL,
a 30 s busy timeout). ``synchronous=FULL``: a committed count survives a power loss.

What is exact where. The file lives next to the blobs, on the host that holds the store
folder. With a Chroma server (``store.url``) the index rows are shared but this file is
not: processes on one host sharing one store folder count exactly together; processes on
other hosts count in their own folder's file. Do not put the store folder on a network
file system for several hosts: SQLite's locking is not reliable there.

Rows are keyed by (namespace, memory id): ids are unique per store.

The ``pending_deletes`` table is the delete journal: a memory being deleted is written
there (committed) before its index rows go, and removed after its blob and counters have
gone. A crash in between leaves a journal entry that ``check`` reports and ``check
--repair`` finishes, instead of rebuilding rows from a blob whose delete was intended.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from elm_memory.errors import StoreError
from elm_memory.faults import point

FILENAME = "utility.sqlite3"
#: What the answer path did with a used memory (see ``record_outcome``).
Outcome = Literal["agree", "won", "lost", "unjudged"]
OUTCOMES: tuple[str, ...] = ("agree", "won", "lost", "unjudged")
_COLUMN = {"agree": "agreed", "won": "won", "lost": "lost"}
#: The counter columns of the utility table, in table order (after namespace and memory_id).
_COUNTER_COLUMNS = (
    "usage",
    "last_used_at",
    "retrieved",
    "agreed",
    "won",
    "lost",
    "sim_sum",
    "sim_n",
    "gold_right",
    "gold_wrong",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS utility (
    namespace    TEXT NOT NULL,
    memory_id    TEXT NOT NULL,
    usage        INTEGER NOT NULL DEFAULT 0,  -- times a query returned it (any rank)
    last_used_at REAL    NOT NULL DEFAULT 0,
    retrieved    INTEGER NOT NULL DEFAULT 0,  -- times an answer used it
    agreed       INTEGER NOT NULL DEFAULT 0,
    won          INTEGER NOT NULL DEFAULT 0,
    lost         INTEGER NOT NULL DEFAULT 0,
    sim_sum      REAL    NOT NULL DEFAULT 0,
    sim_n        INTEGER NOT NULL DEFAULT 0,
    gold_right   INTEGER NOT NULL DEFAULT 0,  -- answers graded against a gold answer (evaluation runs)
    gold_wrong   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, memory_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pending_deletes (
    namespace   TEXT NOT NULL,
    memory_id   TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    blobs       TEXT NOT NULL,  -- space-separated sha256 names
    started_at  REAL NOT NULL,
    PRIMARY KEY (namespace, memory_id)
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class Utility:
    """One memory's counters. ``utility`` = (won + agreed) / (won + agreed + lost), None before any judgement."""

    namespace: str
    memory_id: str
    usage: int = 0
    last_used_at: float = 0.0
    retrieved: int = 0
    agreed: int = 0
    won: int = 0
    lost: int = 0
    sim_sum: float = 0.0
    sim_n: int = 0
    gold_right: int = 0
    gold_wrong: int = 0

    @property
    def observations(self) -> int:
        return self.won + self.agreed + self.lost

    @property
    def utility(self) -> float | None:
        n = self.observations
        return (self.won + self.agreed) / n if n else None

    @property
    def smoothed_utility(self) -> float:
        """Laplace-smoothed utility (a memory never judged scores 0.5): what eviction ranks by."""
        return (self.won + self.agreed + 1) / (self.observations + 2)

    @property
    def mean_similarity(self) -> float | None:
        return self.sim_sum / self.sim_n if self.sim_n else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "observations": self.observations,
            "utility": self.utility,
            "mean_similarity": self.mean_similarity,
        }


#: The counters a listing shows for one memory (``elm memories stats``, the LangGraph store's item values),
#: in column order, with what a memory never counted shows.
SHOWN_COUNTERS: dict[str, Any] = {
    "retrieved": 0,
    "agreed": 0,
    "won": 0,
    "lost": 0,
    "observations": 0,
    "utility": None,
    "mean_similarity": None,
    "gold_right": 0,
    "gold_wrong": 0,
}


def shown_counters(utility: Utility | None) -> dict[str, Any]:
    """:data:`SHOWN_COUNTERS` of one memory (``None``: never counted)."""
    counted = utility.to_dict() if utility is not None else SHOWN_COUNTERS
    return {name: counted[name] for name in SHOWN_COUNTERS}


@dataclass(frozen=True)
class PendingDelete:
    namespace: str
    memory_id: str
    fingerprint: str
    blobs: tuple[str, ...]
    started_at: float


class UtilityTable:
    """The side table of one store folder (created on first use)."""

    def __init__(self, root: str | Path):
        self.path = Path(root).expanduser() / FILENAME
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            deadline = time.monotonic() + 30.0
            while True:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
                    # switching to WAL can fail with "locked" without waiting (SQLite does not call the busy
                    # handler for it) when several connections open a new file at once: retry below
                    if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("PRAGMA synchronous=FULL")
                    conn.execute("PRAGMA secure_delete=ON")  # deleted rows are zeroed, not left in free pages
                    conn.executescript(_SCHEMA)
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise StoreError(f"cannot open the utility table {self.path}: {exc}") from None
                    time.sleep(0.05)
                except (sqlite3.Error, OSError) as exc:
                    raise StoreError(f"cannot open the utility table {self.path}: {exc}") from None
            self._conn = conn
        return self._conn

    def _run(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """Several statements in one transaction (all or none)."""
        with self._lock:
            db = self._db()
            try:
                db.execute("BEGIN IMMEDIATE")
                for sql, args in statements:
                    db.execute(sql, args)
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise StoreError(f"utility table {self.path}: {exc}") from None

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db().execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"utility table {self.path}: {exc}") from None

    @staticmethod
    def _bump(namespace: str, memory_id: str, **add: float) -> tuple[str, Sequence[Any]]:
        """One atomic upsert adding ``add`` to the named columns (``last_used_at`` takes the max)."""
        cols = list(add)
        sets = ", ".join(
            f"{c} = max({c}, excluded.{c})" if c == "last_used_at" else f"{c} = {c} + excluded.{c}" for c in cols
        )
        sql = (
            f"INSERT INTO utility (namespace, memory_id, {', '.join(cols)}) "
            f"VALUES (?, ?, {', '.join('?' for _ in cols)}) "
            f"ON CONFLICT (namespace, memory_id) DO UPDATE SET {sets}"
        )
        return sql, [namespace, memory_id, *add.values()]

    # -- counting ------------------------------------------------------------------------
    def record_usage(self, namespace: str, memory_ids: Sequence[str], now: float | None = None) -> None:
        now = time.time() if now is None else now
        point("utility.usage")
        self._run(self._bump(namespace, m, usage=1, last_used_at=now) for m in dict.fromkeys(memory_ids))

    def record_outcome(self, namespace: str, memory_id: str, outcome: str, similarity: float | None = None) -> None:
        if outcome not in OUTCOMES:
            raise StoreError(f"unknown outcome {outcome!r}: expected one of {', '.join(OUTCOMES)}")
        add: dict[str, float] = {"retrieved": 1}
        if outcome in _COLUMN:
            add[_COLUMN[outcome]] = 1
        if similarity is not None and math.isfinite(similarity):
            add["sim_sum"], add["sim_n"] = float(similarity), 1
        self._run([self._bump(namespace, memory_id, **add)])

    def record_ground_truth(self, namespace: str, memory_id: str, correct: bool) -> None:
        self._run([self._bump(namespace, memory_id, **{"gold_right" if correct else "gold_wrong": 1})])

    # -- reading -------------------------------------------------------------------------
    def get(
        self, namespace: str | None = None, memory_ids: Sequence[str] | None = None
    ) -> dict[tuple[str, str], Utility]:
        """Counters by (namespace, id); ``namespace=None``: every namespace."""
        if not self.path.exists():
            return {}
        sql, args = "SELECT * FROM utility", []
        if namespace is not None:
            sql, args = sql + " WHERE namespace = ?", [namespace]
        rows = self._query(sql, args)
        wanted = None if memory_ids is None else set(memory_ids)
        return {(r[0], r[1]): Utility(*r) for r in rows if wanted is None or r[1] in wanted}

    # -- deleting ------------------------------------------------------------------------
    def forget(self, namespace: str, memory_ids: Sequence[str]) -> None:
        """Drop counters and journal entries of deleted memories (one transaction)."""
        self._run(
            (sql, [namespace, m])
            for m in memory_ids
            for sql in (
                "DELETE FROM utility WHERE namespace = ? AND memory_id = ?",
                "DELETE FROM pending_deletes WHERE namespace = ? AND memory_id = ?",
            )
        )

    def begin_deletes(self, entries: Sequence[PendingDelete]) -> None:
        self._run(_journal(entries))

    def absorb(self, namespace: str, into: str, entries: Sequence[PendingDelete]) -> None:
        """Add the counters of ``entries``' memories to ``into``'s and journal their deletes, in one
        transaction (a merge: the merged memory inherits its members' record exactly once, because a
        journalled member is never absorbed again). Counts add up; ``last_used_at`` takes the max."""
        ids = [e.memory_id for e in entries]
        if not ids:
            return
        totals = ", ".join(f"coalesce({'max' if c == 'last_used_at' else 'sum'}({c}), 0)" for c in _COUNTER_COLUMNS)
        updates = ", ".join(
            f"{c} = max({c}, excluded.{c})" if c == "last_used_at" else f"{c} = {c} + excluded.{c}"
            for c in _COUNTER_COLUMNS
        )
        sql = (
            f"INSERT INTO utility (namespace, memory_id, {', '.join(_COUNTER_COLUMNS)}) "
            f"SELECT ?, ?, {totals} FROM utility "
            f"WHERE namespace = ? AND memory_id IN ({', '.join('?' for _ in ids)}) GROUP BY namespace "
            f"ON CONFLICT (namespace, memory_id) DO UPDATE SET {updates}"
        )
        self._run([(sql, [namespace, into, namespace, *ids]), *_journal(entries)])

    def pending(self, namespace: str | None = None, memory_ids: Sequence[str] | None = None) -> list[PendingDelete]:
        if not self.path.exists():
            return []
        rows = self._query("SELECT * FROM pending_deletes ORDER BY started_at")
        wanted = None if memory_ids is None else set(memory_ids)
        return [
            PendingDelete(r[0], r[1], r[2], tuple(r[3].split()), r[4])
            for r in rows
            if (namespace is None or r[0] == namespace) and (wanted is None or r[1] in wanted)
        ]

    def checkpoint(self) -> None:
        """Fold the WAL into the main file and truncate it, so deleted rows leave no copy in the WAL."""
        if self._conn is not None:
            self._query("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _journal(entries: Sequence[PendingDelete]) -> list[tuple[str, list[Any]]]:
    """The statements that journal ``entries``' deletes (run inside a caller's transaction)."""
    return [
        (
            "INSERT OR REPLACE INTO pending_deletes VALUES (?, ?, ?, ?, ?)",
            [e.namespace, e.memory_id, e.fingerprint, " ".join(e.blobs), e.started_at],
        )
        for e in entries
    ]
