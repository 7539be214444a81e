"""The store's half of a merge: reading a collection's keys, and replacing members by their merged memory.

Commit order (``commit_merge``), so that a crash (kill -9) at any point leaves a pool that
``check`` finds clean or ``check --repair`` makes clean, with each member's experience held
exactly once, by the members or by the merged memory:

1. the merged memory is put (blob, then rows: the ordinary write path). Its metadata names
   the members (``merged_from``), so from the moment its blob exists it *is* the merge's
   journal: ``check`` reports members still present next to it as an interrupted merge, and
   a repair finishes the merge (never undoes it);
2. one transaction adds the members' utility counters to the merged memory's and journals
   the members' deletes (a member already journalled is never absorbed again, so counters
   are summed exactly once);
3. the members go through the journalled delete path (rows, blobs, counters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from elm_memory import faults
from elm_memory.errors import ELMError, StoreError
from elm_memory.memory import LatentMemory
from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.deletes import DeleteJournal
from elm_memory.store.chroma.index import Collection
from elm_memory.store.chroma.rows import IndexRow, MemoryKey, group_by_memory
from elm_memory.store.utility import PendingDelete

log = logging.getLogger(__name__)
#: Nearest memories a landing memory is compared with under ``store.merge_threshold``.
MERGE_CANDIDATES = 16


class MergeSupport(DeleteJournal):
    """Key matrices for clustering, and the crash-safe replacement of members by a merged memory."""

    merge_threshold: float | None
    _merging: bool  # a merge's own put must not start another

    def key_collections(self, kind: str, namespace: str | None = None) -> list[Collection]:
        """The collections of key ``kind`` (every model's when the store is unbound), one namespace or all."""
        return self._collections(kind=kind, namespace=namespace)

    def key_matrix(self, col: Collection) -> tuple[list[str], list[float], np.ndarray]:
        """Ids, creation times and key vectors (rows of a float32 matrix) of one collection, oldest first."""
        ids, metas, matrix = self._all_keys(col)
        created = [float(m.get("created_at", 0.0)) for m in metas]
        order = sorted(range(len(ids)), key=lambda i: (created[i], ids[i]))
        return [ids[i] for i in order], [created[i] for i in order], matrix[order]

    def commit_merge(self, merged: LatentMemory) -> list[str]:
        """Put ``merged``, then move its members' counters to it and delete the members (see the
        module docstring for the order). Returns the ids of the members that were deleted."""
        meta = merged.meta
        if not meta.merged_from:
            raise StoreError(f"memory {merged.id[:8]} names no members (merged_from is empty)")
        members = self._member_rows(meta.model_fingerprint, meta.namespace, meta.merged_from)
        missing = sorted(set(meta.merged_from) - {mid for mid, _, _ in members})
        if missing:
            raise StoreError(f"cannot merge: memory {missing[0]} is not in namespace {meta.namespace!r}")
        self.put_many([merged])
        faults.point("merge.written")
        self.absorb_members(merged.id, members)
        faults.point("merge.absorbed")
        self._delete_memories(members)
        return sorted(mid for mid, _, _ in members)

    def merge_on_put(self, memories: Sequence[LatentMemory]) -> list[str]:
        """``store.merge_threshold``: merge each memory just put with its near-duplicates in its namespace
        (the cluster containing it, complete link, ``average`` strategy); returns the merged ids.

        Near-duplicates are found with one top-``MERGE_CANDIDATES`` query of its key (``input``, else its
        first kind), so the cost per put does not grow with the pool. The put has succeeded before this
        runs: a merge that fails (e.g. a member's blob is unreadable) is logged and leaves the memories
        as they are (or, interrupted, for ``check --repair`` to finish), never fails the put."""
        try:
            return self._merge_landed(memories)
        except ELMError as exc:
            log.warning("merging landed memories skipped: %s", exc)
            return []

    def _merge_landed(self, memories: Sequence[LatentMemory]) -> list[str]:
        from elm_memory.store.merge import average_memory, cluster_keys

        threshold = self.merge_threshold
        assert threshold is not None
        merged_ids: list[str] = []
        gone: set[str] = set()
        for m in memories:
            if m.id in gone or not m.keys:
                continue
            kind = "input" if "input" in m.keys else sorted(m.keys)[0]
            found = self._open(m.meta.model_fingerprint, kind, m.meta.namespace)
            if found is None:
                continue
            key = m.keys[kind].numpy().astype(np.float32)
            with chroma_errors(f"querying {found[0].name}"):
                res = found[1].query(
                    query_embeddings=key[None, :], n_results=MERGE_CANDIDATES, include=["distances", "embeddings"]
                )
            near = [
                (mid, np.asarray(emb, dtype=np.float32))
                for mid, dist, emb in zip(res["ids"][0], res["distances"][0], res["embeddings"][0], strict=True)
                if mid != m.id and 1.0 - float(dist) >= threshold
            ]
            if not near:
                continue
            ids = [m.id] + [mid for mid, _ in near]
            clusters = cluster_keys(np.stack([key] + [emb for _, emb in near]), threshold)
            rows = next((r for r, _ in clusters if 0 in r), None)
            if rows is None:
                continue
            members = sorted(
                (self.get(ids[i], m.meta.namespace) for i in rows), key=lambda x: (x.meta.created_at, x.id)
            )
            if any(x.kind != "soft_prompt" for x in members):
                continue  # only soft prompts are averaged: a lora/prefix memory lands unmerged
            merged = average_memory(members)
            self._merging = True
            try:
                gone.update(self.commit_merge(merged))
            finally:
                self._merging = False
            merged_ids.append(merged.id)
        return merged_ids

    def absorb_members(self, merged_id: str, members: dict[MemoryKey, list[IndexRow]]) -> None:
        """Step 2: one transaction adds the members' counters to ``merged_id`` and journals their deletes."""
        now = time.time()
        by_ns: dict[str, list[PendingDelete]] = {}
        for (mid, fp, ns), rows in members.items():
            blobs = tuple(sorted({str(r.meta["blob"]) for r in rows if r.meta.get("blob")}))
            by_ns.setdefault(ns, []).append(PendingDelete(ns, mid, fp, blobs, now))
        for ns, entries in by_ns.items():
            self.utility.absorb(ns, merged_id, entries)

    def _member_rows(
        self, fingerprint: str, namespace: str, member_ids: Sequence[str]
    ) -> dict[MemoryKey, list[IndexRow]]:
        """Every row of each member (all key kinds) of one model and namespace."""
        rows = [
            r
            for col in self._collections(fingerprint=fingerprint, namespace=namespace)
            for r in self._rows(col, list(member_ids))
        ]
        return group_by_memory(rows)
