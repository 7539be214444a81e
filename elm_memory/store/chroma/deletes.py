"""Journalled deletes: one memory, a whole namespace, and the cleanup of an interrupted delete.

Delete order (``delete``, ``delete_namespace``, eviction, TTL expiry): journal entry in
``utility.sqlite3`` -> index rows -> blob -> counters and journal entry. The journal entry
goes first so that a crash after the rows went is finished by ``check --repair`` rather
than undone (a blob without rows otherwise reads as an interrupted put); rows go before
the blob, so no row ever points at a missing blob.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from elm_memory.faults import point
from elm_memory.memory.ids import validate_namespace
from elm_memory.store.blobs import BlobStore
from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.index import ChromaIndex, Collection
from elm_memory.store.chroma.rows import IndexRow, MemoryKey, group_by_memory
from elm_memory.store.utility import PendingDelete, UtilityTable

log = logging.getLogger(__name__)


class DeleteJournal(ChromaIndex):
    """Deleting memories so that a crash at any step is finished, never undone, by ``check --repair``."""

    root: Path
    url: str | None
    blobs: BlobStore
    utility: UtilityTable
    # called with each deleted memory id, e.g. to drop a serving process's cached copy
    _delete_listeners: list[Callable[[str], None]]

    def delete(self, memory_id: str, namespace: str | None = None) -> bool:
        """Delete one memory: index rows, blob, counters (journalled: see the module docstring)."""
        rows = self._find(memory_id, namespace)
        if not rows:
            return False
        self._delete_memories(group_by_memory(rows))
        return True

    def delete_namespace(self, namespace: str) -> list[str]:
        """Delete every memory of ``namespace`` (every model's) and its collections; returns the ids."""
        validate_namespace(namespace)
        cols = self._collections(namespace=namespace, all_models=True)
        rows = [r for col in cols for r in self._rows(col)]
        self._delete_memories(group_by_memory(rows), drop=cols)
        # a counter or journal entry with no rows left (e.g. recorded while the delete ran)
        stray = {k[1] for k in self.utility.get(namespace)} | {p.memory_id for p in self.utility.pending(namespace)}
        if stray:
            self.utility.forget(namespace, sorted(stray))
        self.utility.checkpoint()
        return sorted({r.id for r in rows} | stray)

    def compact_index(self) -> bool:
        """VACUUM the embedded Chroma database, so deleted rows leave no bytes in its free pages.

        SQLite frees a deleted row's page without zeroing it: after a delete the question preview,
        ids and keys stay readable in ``chroma/chroma.sqlite3`` until the space is reused. VACUUM
        rewrites the file without them. It needs a moment with no other writer (False, and a
        warning, if another process holds a write lock past the timeout); a server's (``url``)
        database is the server's to compact.
        """
        if self.url is not None:
            return False
        path = self.root / "chroma" / "chroma.sqlite3"
        try:
            conn = sqlite3.connect(path, timeout=10.0)
            try:
                conn.execute("VACUUM")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            log.warning("could not compact %s: %s", path, exc)
            return False
        return True

    def add_delete_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(memory_id)`` after each memory this store object deletes (caches drop copies)."""
        self._delete_listeners.append(listener)

    def _delete_memories(
        self, victims: Mapping[MemoryKey, Sequence[IndexRow]], drop: Sequence[Collection] = ()
    ) -> None:
        """Journal -> rows (or whole collections, ``drop``) -> blobs -> counters and journal."""
        if not victims:
            return
        now = time.time()
        self.utility.begin_deletes(
            [
                PendingDelete(
                    ns, mid, fp, tuple(sorted({str(r.meta["blob"]) for r in rows if r.meta.get("blob")})), now
                )
                for (mid, fp, ns), rows in victims.items()
            ]
        )
        point("delete.journalled")
        dropped = {info.name for info, _ in drop}
        by_col: dict[str, tuple[Collection, list[str]]] = {}
        for rows in victims.values():
            for r in rows:
                if r.coll.name not in dropped:
                    by_col.setdefault(r.coll.name, (self._open_info(r.coll), []))[1].append(r.id)
        for col, ids in by_col.values():
            self._delete_rows(col, ids)
        for info, _ in drop:
            with chroma_errors(f"dropping collection {info.name}"):
                self.client.delete_collection(info.name)
            self._forget(info.name)
        point("delete.rows_removed")
        self._delete_unused_blobs(victims)
        point("delete.blobs_removed")
        ids_by_ns: dict[str, list[str]] = {}
        for mid, _, ns in victims:
            ids_by_ns.setdefault(ns, []).append(mid)
        for ns, ids in ids_by_ns.items():
            self.utility.forget(ns, ids)
        for mid, _, _ in victims:
            for listener in self._delete_listeners:
                try:
                    listener(mid)
                except Exception:  # a cache's failure must not undo or fail a finished delete
                    continue

    def _delete_unused_blobs(self, victims: Mapping[MemoryKey, Sequence[IndexRow]]) -> None:
        """The victims' blobs, but one a row of the same namespace still names (re-put meanwhile)."""
        shas_by_ns: dict[str, set[str]] = {}
        for (_, _, ns), rows in victims.items():
            shas_by_ns.setdefault(ns, set()).update(str(r.meta["blob"]) for r in rows if r.meta.get("blob"))
        for ns, shas in shas_by_ns.items():
            for sha in sorted(shas - self._blobs_in_use(ns, shas)):
                self.blobs.delete(sha)

    def _blobs_in_use(self, namespace: str, shas: set[str]) -> set[str]:
        """Which of ``shas`` rows of ``namespace`` still name.

        A blob's bytes hold its memory's id, namespace and model, so content addressing never
        makes two memories share one; only rows of the same namespace can name it (a memory
        re-put while being deleted). Searching only that namespace keeps a delete cheap with
        many namespaces.
        """
        used: set[str] = set()
        wanted = sorted(shas)
        for info, c in self._collections(namespace=namespace, all_models=True):
            for start in range(0, len(wanted), 500):
                part = wanted[start : start + 500]
                with chroma_errors(f"reading {info.name}"):
                    res = c.get(where={"blob": {"$in": part}}, include=["metadatas"])
                used.update(str((m or {}).get("blob")) for m in res["metadatas"])
        return used & shas

    def _finish_pending(self, memory_ids: Sequence[str]) -> None:
        """Complete interrupted deletes of ids about to be written again: a later ``check --repair``
        must not delete the new version, and the old one's counters must not carry over."""
        for p in self.utility.pending(memory_ids=memory_ids):
            rows = [r for r in self._find(p.memory_id, p.namespace) if r.coll.fingerprint == p.fingerprint]
            if rows:
                self._delete_memories(group_by_memory(rows))
            else:
                for sha in p.blobs:
                    if not self._blobs_in_use(p.namespace, {sha}):
                        self.blobs.delete(sha)
                self.utility.forget(p.namespace, [p.memory_id])
