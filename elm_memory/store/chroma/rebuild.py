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

import numpy as np

from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.index import ChromaIndex

_PAGE = 5000


class IndexRebuild(ChromaIndex):
    def rebuild_index(self, namespace: str | None = None) -> int:
        """Rewrite every collection of ``namespace`` (all when None) with only its live rows; returns rows
        written. Empty collections are left to ``check --repair``."""
        written = 0
        for info, c in self._collections(namespace=namespace, all_models=True):
            ids: list[str] = []
            vectors: list[np.ndarray] = []
            metas: list[dict] = []
            offset = 0
            with chroma_errors(f"reading {info.name}"):
                while True:
                    res = c.get(include=["embeddings", "metadatas"], limit=_PAGE, offset=offset)
                    ids.extend(res["ids"])
                    if len(res["ids"]):
                        vectors.append(np.asarray(res["embeddings"], dtype=np.float32))
                    metas.extend(dict(m or {}) for m in res["metadatas"])
                    if len(res["ids"]) < _PAGE:
                        break
                    offset += _PAGE
            if not ids:
                continue
            with chroma_errors(f"dropping collection {info.name}"):
                self.client.delete_collection(info.name)
            self._forget(info.name)
            col = self._create(info.fingerprint, info.kind, info.namespace, info.hidden_size, info.dim)
            self._upsert_rows(col, ids, np.concatenate(vectors), metas)
            written += len(ids)
        return written
