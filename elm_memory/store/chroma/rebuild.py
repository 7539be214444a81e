"""Rebuilding a namespace's collections, so that an index shrunk by eviction is searched at its new size.

Why: Chroma's HNSW index only marks a deleted entry; its files keep every vector ever added and a
search still walks through the deleted ones (``benchmarks/pool_scale.py``: after evicting 10,000
memories to 1,000 the top-1 query was no faster, and the Chroma folder hardly smaller). A rebuild
reads the live rows (ids, keys, metadata), drops the collection and writes them into a fresh one
with the same name, settings and metadata.

Crash safety: the blob is the source of truth (see ``base.py``): a crash after the drop leaves
blobs without rows, which ``check --repair`` reindexes (usage and utility live in
``utility.sqlite3``, not in the rows, so nothing is lost). A query meanwhile finds no collection
(the store's query handles that) and answers zero-shot; it never fails.
"""

from __future__ import annotations

from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.index import ChromaIndex


class IndexRebuild(ChromaIndex):
    def rebuild_index(self, namespace: str | None = None) -> int:
        """Rewrite every collection of ``namespace`` (all when None) with only its live rows; returns rows
        written. Empty collections are left to ``check --repair``."""
        written = 0
        for col in self._collections(namespace=namespace, all_models=True):
            info = col[0]
            ids, metas, vectors = self._all_keys(col)
            if not ids:
                continue
            with chroma_errors(f"dropping collection {info.name}"):
                self.client.delete_collection(info.name)
            self._forget(info.name)
            fresh = self._create(info.fingerprint, info.kind, info.namespace, info.hidden_size, info.dim)
            self._upsert_rows(fresh, ids, vectors, metas)
            written += len(ids)
        return written
