"""``ChromaMemoryStore``: memories in a blob folder, their keys in Chroma collections.

This module holds the class callers use and the operations that touch both halves: the
write path (checks, blobs, rows), reads and search, and the utility counters. What it
inherits, one part a module: :mod:`.index` (collections and rows), :mod:`.deletes` (the
delete journal), :mod:`.capacity` (eviction and TTL), :mod:`.check` (check and repair),
:mod:`.merges` (key matrices and the crash-safe commit of a merge), :mod:`.rebuild` (fresh
collections after a large eviction).

Write order (crash safety): blob (temp, fsync, rename) -> index rows -> removal of the
superseded blob, so after any crash no row points at a missing blob and
``check(repair=True)`` rebuilds rows from a blob (an interrupted put). Embedded Chroma is
single-process: open one store per folder per process (use a server to share it).

Usage and utility counters live in ``utility.sqlite3`` (see ``utility.py``: exact under
concurrency), not in the rows; rows written by older versions keep their ``usage`` field,
which ``list``/``record`` add to the table's count.
"""

from __future__ import annotations

import builtins  # annotations below the method named `list` must say builtins.list
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError, MemoryIdConflictError, StoreError
from elm_memory.faults import point
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import validate_namespace
from elm_memory.store.base import MemoryNotFoundError, MemoryRecord, StoreHit
from elm_memory.store.blobs import BlobStore
from elm_memory.store.blobs_fsspec import open_blobs
from elm_memory.store.chroma.capacity import CapacityLimits, check_policy
from elm_memory.store.chroma.check import ConsistencyCheck
from elm_memory.store.chroma.connection import DEFAULT_DATABASE, DEFAULT_TENANT, chroma_errors, connect
from elm_memory.store.chroma.index import Collection
from elm_memory.store.chroma.merges import MergeSupport
from elm_memory.store.chroma.rebuild import IndexRebuild
from elm_memory.store.chroma.rows import CollectionInfo, IndexRow, record_from_rows, row_metadata, usage_by_kind
from elm_memory.store.utility import Utility, UtilityTable

if TYPE_CHECKING:
    from elm_memory.config import StoreConfig
    from elm_memory.models.loading import ModelInfo


def check_key_dims(memory: LatentMemory, model: ModelInfo) -> None:
    """Each key of a registered kind must have the dimension its builder gives for ``model``."""
    from elm_memory.memory.keys import key_builders

    known = set(key_builders.names())
    for kind, key in memory.keys.items():
        if kind in known and key.numel() != key_builders.get(kind)().dim(model):
            raise IncompatibleMemoryError(
                f"memory {memory.id[:8]}: {kind!r} key has {key.numel()} dimensions; "
                f"model {model.name} gives {key_builders.get(kind)().dim(model)}"
            )


class ChromaMemoryStore(ConsistencyCheck, CapacityLimits, MergeSupport, IndexRebuild):
    """Memories in a blob folder, their keys in Chroma collections (one per model/kind/namespace).

    ``model`` binds the store to one model: ``put`` refuses memories made for another
    model (:class:`IncompatibleMemoryError`), and list/count/get/query only see that
    model's memories. Unbound (``model=None``, e.g. the CLI) the store spans all models
    and cannot ``query``; ``known_models`` (fingerprint -> ModelInfo, e.g. the models
    prepared on this machine) then lets ``put`` check shapes against the real model.
    """

    def __init__(
        self,
        path: str | Path = "~/.elm-memory/store",
        *,
        url: str | None = None,
        model: ModelInfo | None = None,
        hnsw: Mapping[str, Any] | None = None,
        client: Any = None,
        known_models: Mapping[str, ModelInfo] | None = None,
        tenant: str = DEFAULT_TENANT,
        database: str = DEFAULT_DATABASE,
        headers: Mapping[str, str] | None = None,
        token_env: str | None = None,
        token_header: str = "Authorization",
        max_memories: int | None = None,
        eviction: str = "lru",
        ttl_days: float | None = None,
        merge_threshold: float | None = None,
        blob_url: str | None = None,
    ):
        self.root = Path(path).expanduser()
        check_policy(eviction)
        if max_memories is not None and max_memories < 1:
            raise StoreError(f"max_memories must be at least 1 (or None for no limit), got {max_memories}")
        if ttl_days is not None and not ttl_days > 0:
            raise StoreError(f"ttl_days must be positive (or None: memories never expire), got {ttl_days}")
        self.max_memories, self.eviction, self.ttl_days = max_memories, eviction, ttl_days
        if merge_threshold is not None and not 0.0 < merge_threshold <= 1.0:
            raise StoreError(f"merge_threshold must be a cosine in (0, 1] (or None: off), got {merge_threshold}")
        self.merge_threshold, self._merging = merge_threshold, False
        self.utility = UtilityTable(self.root)
        self._delete_listeners = []
        self.url = url
        self.tenant, self.database = tenant, database
        self.headers = dict(headers or {})
        self.token_env, self.token_header = token_env, token_header
        self.model = model
        self.known_models = dict(known_models or {})
        self.hnsw = dict(hnsw or {})
        if self.hnsw.get("space", "cosine") != "cosine":
            raise StoreError("memory keys are compared by cosine similarity: hnsw.space must be 'cosine'")
        self.blob_url = blob_url
        self.blobs = open_blobs(blob_url) if blob_url else BlobStore(self.root / "blobs")
        if client is None:
            client = connect(
                self.root,
                url,
                tenant=tenant,
                database=database,
                headers=self.headers,
                token_env=token_env,
                token_header=token_header,
            )
        self.client = client
        self._cols = {}

    @classmethod
    def from_config(cls, cfg: StoreConfig, model: ModelInfo | None = None, **kwargs: Any) -> ChromaMemoryStore:
        from elm_memory.config.location import resolve_store_path  # a copy made with model_copy skips validation

        kwargs.setdefault("hnsw", cfg.hnsw)
        server = {
            "tenant": cfg.tenant,
            "database": cfg.database,
            "headers": cfg.headers,
            "token_env": cfg.token_env,
            "token_header": cfg.token_header,
        }
        # getattr: configs built before these fields
        for name in ("max_memories", "eviction", "ttl_days", "merge_threshold"):
            if hasattr(cfg, name):
                kwargs.setdefault(name, getattr(cfg, name))
        kwargs.setdefault("blob_url", getattr(cfg, "blob_url", None))
        return cls(resolve_store_path(cfg.path), url=cfg.url, model=model, **{**server, **kwargs})

    # ---- writes -----------------------------------------------------------------------------
    def put_many(self, memories: Sequence[LatentMemory]) -> builtins.list[str]:
        """Blobs first (atomic), then one batched upsert per collection, then superseded blobs.

        Every check that can refuse a memory (format, model, shapes, namespace, key dimensions,
        an id another namespace or model already uses) runs before the first byte is
        written, so a refused put leaves nothing behind.
        """
        for m in memories:
            self._check_writable(m)
        self._check_against_store(memories)
        self._finish_pending([m.id for m in memories])
        for m in memories:
            for kind, key in m.keys.items():
                self._create(m.meta.model_fingerprint, kind, m.meta.namespace, m.meta.hidden_size, key.numel())
        shas = [self.blobs.put(m.to_bytes()) for m in memories]
        point("put.blobs_written")
        batches: dict[str, tuple[Collection, list[str], list[np.ndarray], list[dict]]] = {}
        stale_blobs: set[str] = set()
        stale_rows: dict[str, tuple[Collection, list[str]]] = {}
        for m, sha in zip(memories, shas, strict=True):
            meta = m.meta
            previous = self._existing_rows(meta.model_fingerprint, meta.namespace, meta.id, list(m.keys))
            usage = usage_by_kind(previous)
            for r in previous:
                if r.meta.get("blob") and r.meta.get("blob") != sha:
                    stale_blobs.add(str(r.meta["blob"]))
                if r.coll.kind not in m.keys:
                    stale_rows.setdefault(r.coll.name, (self._cols[r.coll.name], []))[1].append(r.id)
            for kind, key in m.keys.items():
                col = self._create(meta.model_fingerprint, kind, meta.namespace, meta.hidden_size, key.numel())
                b = batches.setdefault(col[0].name, (col, [], [], []))
                b[1].append(meta.id)
                b[2].append(key.numpy())
                b[3].append(row_metadata(m, sha, *usage.get(kind, (0, 0.0))))
        for col, ids, vecs, metas in batches.values():
            self._upsert_rows(col, ids, np.stack(vecs).astype(np.float32), metas)
        point("put.rows_written")
        for col, ids in stale_rows.values():
            self._delete_rows(col, ids)
        for sha in stale_blobs - set(shas):
            self.blobs.delete(sha)
        point("put.stale_removed")
        if self.merge_threshold is not None and not self._merging:
            self.merge_on_put(memories)
        if self.ttl_days is not None or self.max_memories is not None:
            self._after_put({m.meta.namespace for m in memories}, [m.id for m in memories])
        return shas

    def _check_writable(self, memory: LatentMemory) -> None:
        if not isinstance(memory, LatentMemory):
            raise StoreError(f"can only store LatentMemory objects, got {type(memory).__name__}")
        memory.validate()  # again: meta and keys are mutable after construction
        ref = self._reference(memory.meta.model_fingerprint)
        if ref is not None:
            memory.check_compatible(ref)
            check_key_dims(memory, ref)
        validate_namespace(memory.meta.namespace)
        if not memory.keys:
            raise StoreError(f"memory {memory.id[:8]} has no retrieval keys; index it with Retriever.index_memory")

    def _reference(self, fingerprint: str) -> ModelInfo | None:
        """The model a memory's shapes are checked against: the bound one, or a known one by fingerprint."""
        return self.model if self.model is not None else self.known_models.get(fingerprint)

    def _check_against_store(self, memories: Sequence[LatentMemory]) -> None:
        """Refuse ids used elsewhere in the store, and shapes the store's index disagrees with.

        Ids are unique per store, across namespaces and models: rows and blobs are matched
        by id, so a second memory with the same id would merge with the first in ``record``
        and ``delete``. Costs one listing and one lookup per collection per put.
        """
        by_id: dict[str, LatentMemory] = {}
        for m in memories:
            first = by_id.setdefault(m.id, m)
            if first is not m and (first.meta.namespace, first.meta.model_fingerprint) != (
                m.meta.namespace,
                m.meta.model_fingerprint,
            ):
                raise MemoryIdConflictError(f"memory id {m.id} appears twice in one put, in different namespaces")
        # listed directly, not through _collections: opening another model's collections here
        # would apply this process's HNSW overrides to them
        with chroma_errors("listing collections"):
            listed = self.client.list_collections()
        cols = [(info, c) for c in listed if (info := CollectionInfo.of(c)) is not None]
        self._check_shapes(memories, cols)
        for col in cols:
            for r in self._rows(col, list(by_id)):
                m = by_id[r.id]
                if (r.coll.fingerprint, r.coll.namespace) != (m.meta.model_fingerprint, m.meta.namespace):
                    raise MemoryIdConflictError(
                        f"memory id {r.id} is already used in namespace {r.coll.namespace!r} "
                        f"(model {r.coll.fingerprint}); ids are unique per store"
                    )

    def _check_shapes(self, memories: Sequence[LatentMemory], cols: Sequence[Collection]) -> None:
        """With no model to check against (see ``_check_writable``), the shapes this store already
        indexed for the same model are the reference."""
        unchecked = [m for m in memories if self._reference(m.meta.model_fingerprint) is None]
        for info, _ in cols:
            for m in unchecked:
                if info.fingerprint != m.meta.model_fingerprint:
                    continue
                if info.hidden_size != m.meta.hidden_size:
                    raise IncompatibleMemoryError(
                        f"memory {m.id[:8]} has hidden size {m.meta.hidden_size}; the store's index for model "
                        f"{info.fingerprint} (namespace {info.namespace!r}) has {info.hidden_size}"
                    )
                if info.kind in m.keys and m.keys[info.kind].numel() != info.dim:
                    raise StoreError(
                        f"memory {m.id[:8]}: {info.kind!r} key has {m.keys[info.kind].numel()} dimensions; "
                        f"the store's index for model {info.fingerprint} has {info.dim}"
                    )

    def _existing_rows(
        self, fingerprint: str, namespace: str, memory_id: str, kinds: Sequence[str]
    ) -> builtins.list[IndexRow]:
        """Rows of a memory being re-put, looked up by collection name (no listing of all collections).

        Kinds checked: the memory's own, the registered ones and any seen by this process; a
        stale row of another kind is caught by ``check`` (its blob is gone after the put).
        """
        from elm_memory.memory.keys import key_builders

        seen = {info.kind for info, _ in self._cols.values()}
        rows: list[IndexRow] = []
        for kind in sorted(set(kinds) | set(key_builders.names()) | seen):
            col = self._open(fingerprint, kind, namespace)
            if col is not None:
                rows.extend(self._rows(col, [memory_id]))
        return rows

    # ---- reads ------------------------------------------------------------------------------
    def _bound(self) -> ModelInfo:
        if self.model is None:
            raise StoreError("this memory store is not bound to a model; open it with model=<ModelInfo> to query")
        return self.model

    def record(self, memory_id: str, namespace: str | None = None) -> MemoryRecord:
        """The index record of one memory (all its key kinds), without opening the blob."""
        rows = self._find(memory_id, namespace)
        if not rows:
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise MemoryNotFoundError(f"no memory {memory_id!r}{where} in {self.url or self.root}")
        [record] = self._with_usage([record_from_rows(rows)])
        return record

    def _ids_matching(self, prefixes: Sequence[str], namespace: str | None) -> Iterator[tuple[str, str]]:
        """Ids only, never metadata or blobs: ids typed in full are looked up directly (what scripts pass);
        otherwise every collection's ids are paged through once for all ``prefixes``."""
        cols = self._collections(namespace=namespace)
        exact = [(r.id, r.coll.namespace) for col in cols for r in self._rows(col, prefixes)]
        if {memory_id for memory_id, _ in exact} == set(prefixes):
            yield from exact
            return
        starts = tuple(prefixes)
        for info, c in cols:
            with chroma_errors(f"reading {info.name}"):
                for res in self._pages(c, []):
                    yield from ((i, info.namespace) for i in res["ids"] if i.startswith(starts))

    def _with_usage(self, records: Sequence[MemoryRecord]) -> builtins.list[MemoryRecord]:
        """Add the side table's usage count and last-used time to what the rows carry (older versions
        counted in the rows)."""
        out: list[MemoryRecord] = []
        by_ns: dict[str, dict[tuple[str, str], Utility]] = {}
        for r in records:
            if r.namespace not in by_ns:
                by_ns[r.namespace] = self.utility.get(r.namespace)
            u = by_ns[r.namespace].get((r.namespace, r.id))
            if u is not None:
                r = replace(r, usage=r.usage + u.usage, last_used_at=max(r.last_used_at, u.last_used_at))
            out.append(r)
        return out

    def load(self, record: MemoryRecord) -> LatentMemory:
        """Read and validate the blob a record points to; it must be the memory the row says."""
        memory = LatentMemory.from_bytes(self.blobs.get(record.blob))
        if (memory.id, memory.meta.namespace, memory.meta.model_fingerprint) != (
            record.id,
            record.namespace,
            record.model_fingerprint,
        ):
            raise MemoryFormatError(
                f"blob {record.blob[:12]} does not hold memory {record.id[:8]} of namespace {record.namespace!r}"
            )
        if self.model is not None:
            memory.check_compatible(self.model)
        return memory

    def list(
        self, namespace: str | None = None, *, kind: str | None = None, limit: int | None = None, offset: int = 0
    ) -> builtins.list[MemoryRecord]:
        """Records sorted by creation time (oldest first); reads index rows only."""
        by_id: dict[str, list[IndexRow]] = {}
        for col in self._collections(namespace=namespace, kind=kind):
            for r in self._rows(col):
                by_id.setdefault(r.id, []).append(r)
        records = sorted((record_from_rows(rows) for rows in by_id.values()), key=lambda r: (r.created_at, r.id))
        return self._with_usage(records[offset : None if limit is None else offset + limit])

    def namespaces(self) -> builtins.list[str]:
        return sorted({info.namespace for info, _ in self._collections()})

    def count(self, namespace: str | None = None, *, kind: str | None = None) -> int:
        """Rows of one kind (fast), or distinct memories over all kinds."""
        cols = self._collections(namespace=namespace, kind=kind)
        if kind is not None:
            with chroma_errors("counting"):
                return sum(c.count() for _, c in cols)
        ids: set[str] = set()
        for info, c in cols:
            with chroma_errors(f"reading {info.name}"):
                ids.update(c.get(include=[])["ids"])
        return len(ids)

    def query(
        self, kind: str, vector: torch.Tensor | np.ndarray, namespace: str, k: int = 1
    ) -> builtins.list[StoreHit]:
        """Top-``k`` by cosine similarity inside one namespace's own collection (no filter)."""
        model = self._bound()
        validate_namespace(namespace)
        if k < 1:
            return []
        vec = torch.as_tensor(vector).detach().to("cpu", torch.float32).reshape(-1).numpy()
        for attempt in (0, 1):
            found = self._open(model.fingerprint, kind, namespace)
            if found is None:
                return []
            info, col = found
            if vec.shape[0] != info.dim:
                raise StoreError(f"{kind!r} query key has {vec.shape[0]} dimensions; the index expects {info.dim}")
            try:
                with chroma_errors(f"querying {info.name}"):
                    res = self._nearest(col, vec, k)
                break
            except StoreError as exc:  # collection deleted behind our cached handle
                if attempt or "does not exist" not in str(exc):
                    raise
                self._forget(info.name)
        hits = []
        for mid, dist, meta in zip(res["ids"][0], res["distances"][0], res["metadatas"][0], strict=True):
            hits.append(StoreHit(record=record_from_rows([IndexRow(info, mid, meta or {})]), score=1.0 - float(dist)))
        return hits

    def _nearest(self, col: Any, vec: np.ndarray, k: int) -> Any:
        """chromadb's top-``k`` result for one vector, never an expired memory."""
        res = col.query(query_embeddings=vec[None, :], n_results=k, include=["distances", "metadatas"])
        if self.ttl_days is not None:
            cutoff = time.time() - self.ttl_days * 86400.0
            if any(float((m or {}).get("created_at", 0.0)) < cutoff for m in res["metadatas"][0]):
                # only then the (slower, filtered) query: expired memories are never returned
                res = col.query(
                    query_embeddings=vec[None, :],
                    n_results=k,
                    include=["distances", "metadatas"],
                    where={"created_at": {"$gte": cutoff}},
                )
        return res

    # ---- counters (utility.sqlite3) -----------------------------------------------------------
    def record_usage(self, kind: str, namespace: str, memory_ids: Sequence[str]) -> None:
        """Count one retrieval for each memory (exact: one atomic upsert each, see ``utility.py``)."""
        if memory_ids:
            self.utility.record_usage(namespace, memory_ids)

    def record_outcome(self, namespace: str, memory_id: str, outcome: str, similarity: float | None = None) -> None:
        """Count what the answer path did with a used memory: ``agree``, ``won``, ``lost`` or ``unjudged``
        (used, but no verifier judged), and its similarity to the question."""
        self.utility.record_outcome(namespace, memory_id, outcome, similarity)

    def record_ground_truth(self, namespace: str, memory_id: str, correct: bool) -> None:
        """Count an answer that used the memory as right or wrong against a gold answer (evaluation runs)."""
        self.utility.record_ground_truth(namespace, memory_id, bool(correct))

    def utility_of(self, namespace: str, memory_ids: Sequence[str] | None = None) -> dict[str, Utility]:
        """Counters of ``namespace``'s memories by id (a memory never counted is absent)."""
        return {mid: u for (_, mid), u in self.utility.get(namespace, memory_ids).items()}
