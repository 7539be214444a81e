"""``check`` and ``check --repair``: find and fix disagreements between blobs, index rows and counters.

The blob is authoritative: missing or stale rows are rebuilt from it (this finishes an
interrupted put), rows without a blob are dropped (this finishes an interrupted delete),
older blobs of a re-put memory are removed, a journalled delete is finished. Each step is
one method below, run in the order :meth:`ConsistencyCheck.check` lists.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.memory import LatentMemory, MemoryMeta
from elm_memory.store.base import CheckReport
from elm_memory.store.blobs import MissingBlobError
from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.deletes import DeleteJournal
from elm_memory.store.chroma.index import Collection
from elm_memory.store.chroma.rows import IndexRow, MemoryKey, blob_meta, row_metadata, usage_by_kind
from elm_memory.store.utility import PendingDelete


class BlobEntry(NamedTuple):
    """A readable blob, as the check groups it by the memory it holds."""

    sha: str
    meta: MemoryMeta
    kinds: list[str]
    mtime: float


@dataclass
class CheckRun:
    """One check's findings so far, handed from step to step (the scans are consumed as steps settle them)."""

    report: CheckReport
    repair: bool
    pending: dict[MemoryKey, PendingDelete]  # the delete journal
    rows: dict[MemoryKey, list[IndexRow]]  # index rows by the memory they name
    blobs: dict[MemoryKey, list[BlobEntry]]  # readable blobs by the memory they hold


class ConsistencyCheck(DeleteJournal):
    """The store's self-check and repair (``elm memories check [--repair]``)."""

    def check(self, repair: bool = False, *, deep: bool = False, temp_grace_seconds: float = 600.0) -> CheckReport:
        """Find (and with ``repair`` fix) disagreements between blobs and rows, over the whole store.

        ``deep`` re-hashes every blob. Temp files younger than ``temp_grace_seconds`` may belong
        to a live writer and are kept.

        Memories are matched by (id, model, namespace), never by id alone: a repair must not
        pick one namespace's memory over another's that shares its id (stores written before
        ids were unique per store); such an id is reported in ``errors`` for a person to resolve.
        Empty collections are dropped on repair: an index keeps the shapes of its first memory,
        so one emptied of a wrong-shaped memory would otherwise refuse the model's own.
        """
        report = CheckReport(repaired=repair)
        pending = {(p.memory_id, p.fingerprint, p.namespace): p for p in self.utility.pending()}
        cols = self._collections(all_models=True)
        rows = self._scan_rows(cols, report)
        run = CheckRun(report, repair, pending, rows, self._scan_blobs(report, repair, deep))
        self._remove_temp_files(report, repair, temp_grace_seconds)
        self._report_shared_ids(run)
        self._finish_merges(run)  # before the journal: a finished merge journals its members
        self._finish_journalled(run)
        self._clean_utility(run)
        for group in sorted(set(run.rows) | set(run.blobs)):
            self._check_memory(run, group)
        self._drop_empty(cols, report, repair)  # after the repairs above, which may have emptied some
        return report

    def _scan_rows(self, cols: Sequence[Collection], report: CheckReport) -> dict[MemoryKey, list[IndexRow]]:
        rows_by_id: dict[MemoryKey, list[IndexRow]] = {}
        for col in cols:
            for r in self._rows(col):
                rows_by_id.setdefault((r.id, r.coll.fingerprint, r.coll.namespace), []).append(r)
                report.rows += 1
        return rows_by_id

    def _scan_blobs(self, report: CheckReport, repair: bool, deep: bool) -> dict[MemoryKey, list[BlobEntry]]:
        """Readable blobs by the memory they hold; unreadable ones are corrupt (removed on repair)."""
        blobs_by_id: dict[MemoryKey, list[BlobEntry]] = {}
        for sha in list(self.blobs):
            report.blobs += 1
            try:
                meta, kinds = blob_meta(self.blobs.read_header(sha))
                if deep:
                    self.blobs.get(sha)
                mtime = self.blobs.mtime(sha)
            except (MemoryFormatError, MissingBlobError, OSError, ValueError, KeyError):
                report.corrupt_blobs.append(sha)
                if repair:
                    self.blobs.delete(sha)
                continue
            group = (meta.id, meta.model_fingerprint, meta.namespace)
            blobs_by_id.setdefault(group, []).append(BlobEntry(sha, meta, kinds, mtime))
        return blobs_by_id

    def _remove_temp_files(self, report: CheckReport, repair: bool, grace_seconds: float) -> None:
        report.temp_files = [str(p) for p in self.blobs.temp_files(older_than=grace_seconds)]
        if repair:
            for p in report.temp_files:
                Path(p).unlink(missing_ok=True)

    @staticmethod
    def _report_shared_ids(run: CheckRun) -> None:
        """One id held by memories of several namespaces or models: for a person to resolve."""
        owners: dict[str, list[str]] = {}
        for mid, fp, ns in run.blobs:
            owners.setdefault(mid, []).append(f"{ns!r} (model {fp})")
        for mid, where in sorted(owners.items()):
            if len(where) > 1:
                run.report.errors.append(
                    f"{mid}: id used by {len(where)} memories, in {', '.join(sorted(where))}; "
                    f"delete all but one with `elm memories delete {mid} --namespace NS`"
                )

    def _finish_merges(self, run: CheckRun) -> None:
        """A merged memory whose members are still here: a merge interrupted after the merged memory was
        written (see ``merges.py``). A repair finishes it: in one transaction the members' counters go to
        the merged memory and their deletes are journalled, so ``_finish_journalled`` deletes them next."""
        for (merged_id, fp, ns), entries in sorted(run.blobs.items()):
            found: list[PendingDelete] = []
            for mid in sorted({m for e in entries for m in e.meta.merged_from}):
                key = (mid, fp, ns)
                if key in run.pending or (key not in run.rows and key not in run.blobs):
                    continue  # gone, or journalled already (its counters were absorbed with the journal entry)
                shas = {str(r.meta["blob"]) for r in run.rows.get(key, []) if r.meta.get("blob")}
                shas |= {b.sha for b in run.blobs.get(key, [])}
                found.append(PendingDelete(ns, mid, fp, tuple(sorted(shas)), time.time()))
            if not found:
                continue
            run.report.interrupted_merges.append(f"{ns}/{merged_id}")
            if run.repair:
                self.utility.absorb(ns, merged_id, found)
                run.pending.update({(p.memory_id, p.fingerprint, p.namespace): p for p in found})

    def _finish_journalled(self, run: CheckRun) -> None:
        """Interrupted deletes: finished, and taken out of the scans (their blob without rows is
        not an interrupted put)."""
        for group, p in sorted(run.pending.items()):
            rows, blobs = run.rows.pop(group, []), run.blobs.pop(group, [])
            run.report.pending_deletes.append(f"{p.namespace}/{p.memory_id}")
            if not rows:
                run.report.orphan_blobs.extend(b.sha for b in blobs)
            if run.repair:
                for r in rows:
                    self._delete_rows(self._open_info(r.coll), [r.id])
                for sha in sorted({b.sha for b in blobs} | set(p.blobs)):
                    self.blobs.delete(sha)
                self.utility.forget(p.namespace, [p.memory_id])
                for listener in self._delete_listeners:
                    listener(p.memory_id)

    def _clean_utility(self, run: CheckRun) -> None:
        """Counters of memories that no longer exist (removed on repair)."""
        live = {(ns, mid) for mid, _, ns in set(run.rows) | set(run.blobs)}
        live |= {(p.namespace, p.memory_id) for p in run.pending.values()}  # handled by _finish_journalled
        for ns, mid in sorted(self.utility.get()):
            if (ns, mid) not in live:
                run.report.orphan_utility.append(f"{ns}/{mid}")
        if run.repair:
            by_ns: dict[str, list[str]] = {}
            for item in run.report.orphan_utility:
                ns, _, mid = item.rpartition("/")
                by_ns.setdefault(ns, []).append(mid)
            for ns, ids in by_ns.items():
                self.utility.forget(ns, ids)

    def _check_memory(self, run: CheckRun, group: MemoryKey) -> None:
        """One memory's rows against its blobs: orphan rows, superseded blobs, rows to rebuild."""
        report, repair = run.report, run.repair
        rows, blobs = run.rows.get(group, []), run.blobs.get(group, [])
        report.memories += 1
        mid = group[0]
        if not blobs:
            report.orphan_rows.extend(f"{r.coll.name}/{r.id}" for r in rows)
            if repair:
                for r in rows:
                    self._delete_rows(self._open_info(r.coll), [r.id])
            return
        # canonical blob: the one most rows point to, then the newest
        refs = {b.sha: sum(1 for r in rows if r.meta.get("blob") == b.sha) for b in blobs}
        sha, meta, kinds, _ = max(blobs, key=lambda b: (refs[b.sha], b.mtime))
        for other in blobs:
            if other.sha != sha:
                report.superseded_blobs.append(other.sha)
                if repair:
                    self.blobs.delete(other.sha)
        owner = (meta.model_fingerprint, meta.namespace)
        good = {
            r.coll.kind
            for r in rows
            if r.meta.get("blob") == sha and r.coll.kind in kinds and (r.coll.fingerprint, r.coll.namespace) == owner
        }
        bad = [r for r in rows if r.coll.kind not in good or (r.coll.fingerprint, r.coll.namespace) != owner]
        report.orphan_rows.extend(f"{r.coll.name}/{r.id}" for r in bad)
        missing = [k for k in kinds if k not in good]
        if missing:
            report.reindexed.append(mid)
        if repair:
            try:
                for r in bad:
                    self._delete_rows(self._open_info(r.coll), [r.id])
                if missing:
                    self._reindex(sha, missing, rows)
            except (StoreError, MemoryFormatError) as exc:  # keep repairing the others
                report.errors.append(f"{mid}: {exc}")

    def _reindex(self, sha: str, kinds: Sequence[str], old_rows: Sequence[IndexRow]) -> None:
        """Rebuild the rows of ``kinds`` from blob ``sha``, keeping usage counters."""
        memory = LatentMemory.from_bytes(self.blobs.get(sha))
        meta = memory.meta
        usage = usage_by_kind(old_rows)
        for kind in kinds:
            key = memory.keys[kind]
            col = self._create(meta.model_fingerprint, kind, meta.namespace, meta.hidden_size, key.numel())
            row = row_metadata(memory, sha, *usage.get(kind, (0, 0.0)))
            self._upsert_rows(col, [meta.id], key.numpy()[None, :].astype(np.float32), [row])

    def _drop_empty(self, cols: Sequence[Collection], report: CheckReport, repair: bool) -> None:
        """Collections without rows; a repair drops them so the next write recreates them with its shapes."""
        for info, c in cols:
            with chroma_errors(f"counting {info.name}"):
                empty = c.count() == 0
            if empty:
                report.empty_collections.append(info.name)
                if repair:
                    with chroma_errors(f"dropping empty collection {info.name}"):
                        self.client.delete_collection(info.name)
                    self._forget(info.name)
