"""The Chroma side of the store: collections (found, created, cached) and their rows, in batches.

:class:`ChromaIndex` is the layer the store's other parts (writes, deletes, capacity,
check) build on; it holds the client and a cache of open collections and knows nothing
of blobs or counters.

Every write is cut into requests of at most the client's ``get_max_batch_size()`` rows
(5461 for chromadb 1.5.9, embedded and server alike; more is refused), so an import of any
size goes through.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from elm_memory.errors import IncompatibleMemoryError, StoreError
from elm_memory.faults import point
from elm_memory.store.base import MemoryStoreBase
from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.rows import SCHEMA, CollectionInfo, IndexRow, collection_name

if TYPE_CHECKING:
    from elm_memory.models.loading import ModelInfo

#: HNSW settings of new collections (chromadb's own defaults, cosine space) ...
DEFAULT_HNSW: dict[str, Any] = {"space": "cosine", "ef_construction": 100, "max_neighbors": 16, "ef_search": 100}
#: ... and per key kind, tuned with benchmarks/retrieval.py. KV queries (attention queries)
#: sit far from every memory key (attention keys): mean cosine ~0.07 against ~0.95 between
#: memories, the hard case for a graph search. Measured recall@1 at 100k memories with
#: max_neighbors 32: ef_search 400 -> 0.99 (24x64 dims) / 0.945 (28x128); 800 -> 1.0 / 0.995.
#: We keep 800: a KV lookup already runs the question through the model, which costs far
#: more than the extra ~10 ms of search. Input keys reach recall 1.0 at 100k with the defaults.
#: ``kv_centered`` keys are spread wider but were not measured at scale: they keep ``kv``'s settings.
KIND_HNSW: dict[str, dict[str, Any]] = {
    "kv": {"max_neighbors": 32, "ef_search": 800},
    "kv_centered": {"max_neighbors": 32, "ef_search": 800},
}
#: Settings chromadb lets us change on an existing collection (the rest are fixed at creation).
MUTABLE_HNSW = ("ef_search", "num_threads", "batch_size", "sync_threshold", "resize_factor")
_PAGE = 5000

#: An open collection: what it indexes and the chromadb handle.
Collection = tuple[CollectionInfo, Any]


class ChromaIndex(MemoryStoreBase):
    """Collections of one Chroma client and their rows; see :class:`ChromaMemoryStore` for the whole."""

    client: Any
    model: ModelInfo | None  # the bound model: only its collections are listed by default
    hnsw: dict[str, Any]  # explicit HNSW overrides (config)
    _cols: dict[str, Collection]  # open collections by name

    # ---- batches ----------------------------------------------------------------------------
    def _batch_size(self) -> int:
        """Most rows one write may carry (the client's limit; 0: none known)."""
        with chroma_errors("reading the Chroma batch limit"):
            n = int(self.client.get_max_batch_size())
        return max(n, 0)  # servers predating the pre-flight check report -1

    def _chunks(self, n: int) -> Iterator[slice]:
        """Slices of ``range(n)`` no longer than the client's batch limit."""
        size = self._batch_size() or max(n, 1)
        for start in range(0, n, size):
            yield slice(start, start + size)

    # ---- collections -------------------------------------------------------------------
    def hnsw_settings(self, kind: str) -> dict[str, Any]:
        """HNSW configuration for a new collection of ``kind``: defaults, per-kind tuning, then overrides."""
        return {**DEFAULT_HNSW, **KIND_HNSW.get(kind, {}), **self.hnsw}

    def _open(self, fingerprint: str, kind: str, namespace: str) -> Collection | None:
        """The collection for (fingerprint, kind, namespace) if it exists."""
        name = collection_name(fingerprint, kind, namespace)
        if name in self._cols:
            return self._cols[name]
        import chromadb.errors

        try:
            with chroma_errors(f"opening collection {name}"):
                try:
                    col = self.client.get_collection(name, embedding_function=None)
                except chromadb.errors.NotFoundError:
                    return None
        except StoreError as exc:  # older servers report a missing collection as a ValueError
            if "does not exist" in str(exc):
                return None
            raise
        return self._remember(col, fingerprint, kind, namespace)

    def _open_info(self, info: CollectionInfo) -> Collection:
        """The collection a row came from, which must still exist."""
        found = self._open(info.fingerprint, info.kind, info.namespace)
        if found is None:
            raise StoreError(f"collection {info.name} disappeared during the check")
        return found

    def _remember(self, col: Any, fingerprint: str, kind: str, namespace: str) -> Collection:
        info = CollectionInfo.of(col)
        if info is None or (info.fingerprint, info.kind, info.namespace) != (fingerprint, kind, namespace):
            raise StoreError(f"Chroma collection {col.name} does not belong to this memory store")
        self._apply_mutable_hnsw(col)
        self._cols[col.name] = (info, col)
        return info, col

    def _apply_mutable_hnsw(self, col: Any) -> None:
        """Bring e.g. ``ef_search`` of an existing collection to an explicitly configured value.

        Only explicit ``hnsw=`` overrides are applied (never the defaults), so a process with
        default settings, like the CLI, does not undo another's tuning. chromadb 1.5.9
        (embedded) reads the value when it first loads the index in a process: the change
        applies from this open on, not to an index this process already searched.
        """
        have = (getattr(col, "configuration", None) or {}).get("hnsw") or {}
        change = {k: self.hnsw[k] for k in MUTABLE_HNSW if k in self.hnsw and k in have and have[k] != self.hnsw[k]}
        if change:
            with chroma_errors(f"updating the HNSW settings of {col.name}"):
                col.modify(configuration={"hnsw": change})

    def _create(self, fingerprint: str, kind: str, namespace: str, hidden_size: int, dim: int) -> Collection:
        """The collection for (fingerprint, kind, namespace), created if missing; shapes must match."""
        found = self._open(fingerprint, kind, namespace)
        if found is not None and (found[0].hidden_size, found[0].dim) != (hidden_size, dim):
            self._forget(found[0].name)  # a cached handle may predate a repair that dropped it
            found = self._open(fingerprint, kind, namespace)
        if found is None:
            name = collection_name(fingerprint, kind, namespace)
            meta = {
                "elm_schema": SCHEMA,
                "model_fingerprint": fingerprint,
                "kind": kind,
                "namespace": namespace,
                "hidden_size": int(hidden_size),
                "dim": int(dim),
                "created_at": time.time(),
            }
            with chroma_errors(f"creating collection {name}"):
                col = self.client.get_or_create_collection(
                    name, configuration={"hnsw": self.hnsw_settings(kind)}, metadata=meta, embedding_function=None
                )
            found = self._remember(col, fingerprint, kind, namespace)
        info = found[0]
        # an index keeps the shapes of its first memory; an emptied one is reset by check --repair
        hint = f" (namespace {namespace!r}; if it holds no memories, `elm memories check --repair` resets its index)"
        if info.hidden_size != hidden_size:
            raise IncompatibleMemoryError(
                f"hidden size {hidden_size} does not match the store's {info.hidden_size} for model {fingerprint}"
                + hint
            )
        if info.dim != dim:
            raise StoreError(
                f"{kind!r} key has {dim} dimensions; the index for model {fingerprint} expects {info.dim}" + hint
            )
        return found

    def _collections(
        self,
        *,
        fingerprint: str | None = None,
        kind: str | None = None,
        namespace: str | None = None,
        all_models: bool = False,
    ) -> list[Collection]:
        """ELM collections matching the filters (only the bound model's unless ``all_models``)."""
        fp = fingerprint if fingerprint is not None else (self.model.fingerprint if self.model else None)
        if all_models:
            fp = None
        with chroma_errors("listing collections"):
            cols = self.client.list_collections()
        out = []
        for col in cols:
            info = CollectionInfo.of(col)
            if info is None:
                continue
            if (fp and info.fingerprint != fp) or (kind and info.kind != kind):
                continue
            if namespace is not None and info.namespace != namespace:
                continue
            if info.name not in self._cols:
                self._apply_mutable_hnsw(col)
                self._cols[info.name] = (info, col)
            out.append(self._cols[info.name])
        return out

    def _forget(self, name: str) -> None:
        self._cols.pop(name, None)

    # ---- rows --------------------------------------------------------------------------
    def _rows(self, col: Collection, ids: Sequence[str] | None = None) -> list[IndexRow]:
        """Rows of one collection: those of ``ids``, or all of them (paged)."""
        info, c = col
        out: list[IndexRow] = []
        with chroma_errors(f"reading {info.name}"):
            if ids is not None:
                # chromadb 1.5 does not limit reads by id, but one request per id batch keeps an
                # import's lookups the size of its writes on any server
                ids = list(ids)
                for part in self._chunks(len(ids)):
                    res = c.get(ids=ids[part], include=["metadatas"])
                    out.extend(IndexRow(info, i, m or {}) for i, m in zip(res["ids"], res["metadatas"], strict=True))
                return out
            for res in self._pages(c, ["metadatas"]):
                out.extend(IndexRow(info, i, m or {}) for i, m in zip(res["ids"], res["metadatas"], strict=True))
            return out

    @staticmethod
    def _pages(c: Any, include: list[str]) -> Iterator[dict[str, Any]]:
        """Every row of collection ``c``, ``_PAGE`` rows a request (``include``: what each page carries)."""
        offset = 0
        while True:
            res = c.get(include=include, limit=_PAGE, offset=offset)
            yield res
            if len(res["ids"]) < _PAGE:
                return
            offset += _PAGE

    def _all_keys(self, col: Collection) -> tuple[list[str], list[dict[str, Any]], np.ndarray]:
        """Ids, metadata and key vectors (rows of a float32 matrix) of every row of one collection."""
        info, c = col
        ids: list[str] = []
        metas: list[dict[str, Any]] = []
        vecs: list[np.ndarray] = []
        with chroma_errors(f"reading {info.name}"):
            for res in self._pages(c, ["embeddings", "metadatas"]):
                ids.extend(res["ids"])
                metas.extend(dict(m or {}) for m in res["metadatas"])
                if len(res["ids"]):
                    vecs.append(np.asarray(res["embeddings"], dtype=np.float32))
        return ids, metas, np.concatenate(vecs) if vecs else np.zeros((0, info.dim), dtype=np.float32)

    def _find(self, memory_id: str, namespace: str | None) -> list[IndexRow]:
        """Every row of one memory id (all kinds; one namespace, or all)."""
        rows: list[IndexRow] = []
        for col in self._collections(namespace=namespace):
            rows.extend(self._rows(col, [memory_id]))
        return rows

    def _upsert_rows(self, col: Collection, ids: list[str], vectors: np.ndarray, metas: list[dict]) -> None:
        """Write index rows (a crash test hook: everything before it is the blob write).

        A failure part-way leaves the earlier batches written: their blobs already are, so
        ``check(repair=True)`` (or putting again) completes the rest.
        """
        with chroma_errors(f"writing to {col[0].name}"):
            for part in self._chunks(len(ids)):
                point("index.upsert")
                col[1].upsert(ids=ids[part], embeddings=vectors[part], metadatas=metas[part])

    def _delete_rows(self, col: Collection, ids: list[str]) -> None:
        with chroma_errors(f"deleting from {col[0].name}"):
            for part in self._chunks(len(ids)):
                point("index.delete")
                col[1].delete(ids=ids[part])
