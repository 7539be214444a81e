"""Chroma-backed :class:`~elm_memory.store.base.MemoryStore`.

Layout under ``StoreConfig.path`` (``~`` expanded)::

    chroma/   embedded Chroma (PersistentClient); unused when ``StoreConfig.url`` is set
    blobs/    content-addressed safetensors memories (see ``blobs.py``)

With ``url`` the index rows live in a Chroma server (``chroma run``; the scale-out
path) and the blobs stay in the local/shared folder. The server's tenant and database
must exist (the store creates only collections); headers and a static token (read from
an environment variable, sent as chromadb's token auth does) authenticate the client.

Every write is cut into requests of at most the client's ``get_max_batch_size()`` rows
(5461 for chromadb 1.5.9, embedded and server alike; more is refused), so an import of any
size goes through.

**One collection per (model fingerprint, key kind, namespace)**, cosine space. A
namespace is therefore a structural boundary, not a ``where`` filter. Measured with
``benchmarks/retrieval.py`` (section ``namespace_isolation``, 20k KV keys, chromadb 1.5.9,
2 busy cores): a ``where`` on the namespace took the top-1 query from 9 ms to 128 ms p50
with every row matching, and to 63 ms when a quarter matched, against 5.2 ms for that
quarter in a collection of its own and 5.6 ms in a database of its own. Collections and
databases isolate equally fast; collections win on handling: a Chroma client is bound
to one database, so a process serving several namespaces would need a client per
namespace, while a collection needs only a name, and works unchanged against a server.

Collection names are ``elm-<fp8>-<kind>-<hash12>`` (Chroma allows 3-63 chars of
``[a-zA-Z0-9._-]``); the exact fingerprint, kind, namespace, hidden size and key
dimension are in the collection metadata and verified on open.

Rows: id = memory id, embedding = the key, metadata = namespace, created time,
question hash and preview, the blob's sha256, training statistics, and the usage
counter (times retrieved) with the last-used time.

Write order (crash safety): blob (temp, fsync, rename) -> index rows -> removal of the
superseded blob. Delete order (``delete``, ``delete_namespace``, eviction, TTL expiry):
journal entry in ``utility.sqlite3`` -> index rows -> blob -> counters and journal entry.
So after any crash no row points at a missing blob, and ``check(repair=True)`` rebuilds
rows from a blob (an interrupted put) or finishes a journalled delete. Embedded Chroma is
single-process: open one store per folder per process (use a server to share it).

Usage and utility counters live in ``utility.sqlite3`` (see ``utility.py``: exact under
concurrency), not in the rows; rows written by older versions keep their ``usage`` field,
which ``list``/``record`` add to the table's count.

Capacity and age (``max_memories``, ``eviction``, ``ttl_days``; see ``StoreConfig``): a put
first removes its namespaces' expired memories, then evicts down to ``max_memories`` (never
a memory the put just wrote). Expired memories are never returned by ``query``.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
import torch

from elm_memory.errors import (
    ELMError,
    IncompatibleMemoryError,
    MemoryFormatError,
    MemoryIdConflictError,
    StoreError,
)
from elm_memory.memory import LatentMemory, MemoryMeta
from elm_memory.store.base import CheckReport, MemoryNotFoundError, MemoryRecord, StoreHit
from elm_memory.store.blobs import BlobStore, MissingBlobError
from elm_memory.store.names import validate_namespace
from elm_memory.store.utility import PendingDelete, Utility, UtilityTable

if TYPE_CHECKING:
    from elm_memory.config import StoreConfig
    from elm_memory.models.loading import ModelInfo

#: HNSW settings of new collections (chromadb's own defaults, cosine space) ...
DEFAULT_HNSW: dict[str, Any] = {"space": "cosine", "ef_construction": 100, "max_neighbors": 16, "ef_search": 100}
#: ... and per key kind, tuned with benchmarks/retrieval.py. KV queries (attention queries)
#: sit far from every memory key (attention keys): mean cosine ~0.07 against ~0.95 between
#: memories, the hard case for a graph search. Measured recall@1 at 100k memories with
#: max_neighbors 32: ef_search 400 -> 0.99 (24x64 dims) / 0.945 (28x128); 800 -> 1.0 / 0.995.
#: We keep 800: a KV lookup already runs the question through the model, which costs far
#: more than the extra ~10 ms of search. Input keys reach recall 1.0 at 100k with the defaults.
KIND_HNSW: dict[str, dict[str, Any]] = {"kv": {"max_neighbors": 32, "ef_search": 800}}
#: Settings chromadb lets us change on an existing collection (the rest are fixed at creation).
MUTABLE_HNSW = ("ef_search", "num_threads", "batch_size", "sync_threshold", "resize_factor")
SCHEMA = 1
#: Eviction policies, by what goes first: least recently used (never used: by creation time),
#: lowest Laplace-smoothed utility (ties: least recently used), oldest creation time.
EVICTION_POLICIES = ("lru", "utility", "oldest")
QUESTION_PREVIEW = 200
_PAGE = 5000
#: chromadb's DEFAULT_TENANT / DEFAULT_DATABASE (here so importing this module needs no chromadb)
DEFAULT_TENANT = "default_tenant"
DEFAULT_DATABASE = "default_database"


def _slug(text: str, n: int) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:n].strip("-") or "k"


def collection_name(fingerprint: str, kind: str, namespace: str) -> str:
    """Deterministic Chroma collection name for one (model, key kind, namespace)."""
    digest = hashlib.sha256(f"{fingerprint}\x00{kind}\x00{namespace}".encode()).hexdigest()[:12]
    return f"elm-{_slug(fingerprint, 8)}-{_slug(kind, 16)}-{digest}"


@contextmanager
def _chroma_errors(action: str) -> Iterator[None]:
    """Chroma/HTTP exceptions -> one-line StoreError; our own typed errors pass through."""
    try:
        yield
    except ELMError:
        raise
    except Exception as exc:  # chromadb raises its own, httpx and ValueError types
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"memory store: {action} failed: {msg}") from None


@dataclass(frozen=True)
class _CollInfo:
    name: str
    fingerprint: str
    kind: str
    namespace: str
    hidden_size: int
    dim: int


@dataclass(frozen=True)
class _Row:
    coll: _CollInfo
    id: str
    meta: Mapping[str, Any]


def _row_metadata(memory: LatentMemory, blob: str, usage: int = 0, last_used_at: float = 0.0) -> dict[str, Any]:
    m, s = memory.meta, memory.meta.stats
    meta: dict[str, Any] = {
        "namespace": m.namespace,
        "created_at": float(m.created_at),
        "question_hash": m.question_hash,
        "question": m.question[:QUESTION_PREVIEW],
        "blob": blob,
        "num_tokens": int(m.num_tokens),
        "usage": int(usage),
        "last_used_at": float(last_used_at),
        "no_consensus": bool(s.no_consensus),
        "train_engine": s.engine,
        "train_objective": s.objective,
        "train_steps": int(s.steps),
        "train_seconds": float(s.seconds),
        "train_reward": float(s.mean_reward[-1]) if s.mean_reward else 0.0,
        "majority_share": float(s.majority_share),
    }
    if s.majority_answer is not None:
        meta["majority_answer"] = str(s.majority_answer)[:QUESTION_PREVIEW]
    return meta


def _record(rows: Sequence[_Row]) -> MemoryRecord:
    """Merge one memory's rows (one per key kind) into a record."""
    first = rows[0].meta
    stats = {k: v for k, v in first.items() if k.startswith("train_") or k in ("majority_share", "majority_answer")}
    return MemoryRecord(
        id=rows[0].id,
        namespace=rows[0].coll.namespace,
        model_fingerprint=rows[0].coll.fingerprint,
        kinds=tuple(sorted(r.coll.kind for r in rows)),
        blob=str(first.get("blob", "")),
        question=str(first.get("question", "")),
        question_hash=str(first.get("question_hash", "")),
        created_at=float(first.get("created_at", 0.0)),
        usage=sum(int(r.meta.get("usage", 0)) for r in rows),
        last_used_at=max(float(r.meta.get("last_used_at", 0.0)) for r in rows),
        no_consensus=bool(first.get("no_consensus", False)),
        stats=stats,
    )


def _usage_by_kind(rows: Sequence[_Row]) -> dict[str, tuple[int, float]]:
    """Usage counters to carry over when rows are rewritten."""
    return {r.coll.kind: (int(r.meta.get("usage", 0)), float(r.meta.get("last_used_at", 0.0))) for r in rows}


def _group(rows: Sequence[_Row]) -> dict[tuple[str, str, str], list[_Row]]:
    """Rows by the memory they index: (id, model fingerprint, namespace)."""
    out: dict[tuple[str, str, str], list[_Row]] = {}
    for r in rows:
        out.setdefault((r.id, r.coll.fingerprint, r.coll.namespace), []).append(r)
    return out


def _eviction_key(policy: str, util: Mapping[str, Utility]) -> Callable[[MemoryRecord], tuple]:
    """Sort key putting the memory to evict first (see ``EVICTION_POLICIES``)."""

    def last_use(r: MemoryRecord) -> float:
        return max(r.last_used_at, r.created_at)

    if policy == "oldest":
        return lambda r: (r.created_at, r.id)
    if policy == "lru":
        return lambda r: (last_use(r), r.created_at, r.id)
    return lambda r: (util[r.id].smoothed_utility if r.id in util else 0.5, last_use(r), r.id)


def _check_key_dims(memory: LatentMemory, model: ModelInfo) -> None:
    """Each key of a registered kind must have the dimension its builder gives for ``model``."""
    from elm_memory.registry import key_builders

    known = set(key_builders.names())
    for kind, key in memory.keys.items():
        if kind in known and key.numel() != key_builders.get(kind)().dim(model):
            raise IncompatibleMemoryError(
                f"memory {memory.id[:8]}: {kind!r} key has {key.numel()} dimensions; "
                f"model {model.name} gives {key_builders.get(kind)().dim(model)}"
            )


def _blob_meta(header: Mapping[str, Any]) -> tuple[MemoryMeta, list[str]]:
    """Memory metadata and key kinds from a blob's safetensors header."""
    raw = (header.get("__metadata__") or {}).get("elm_memory")
    if raw is None:
        raise MemoryFormatError("blob has no elm_memory metadata")
    kinds = sorted(name[4:] for name in header if name.startswith("key."))
    return MemoryMeta.from_json(raw), kinds


class ChromaMemoryStore:
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
    ):
        self.root = Path(path).expanduser()
        if eviction not in EVICTION_POLICIES:
            raise StoreError(f"unknown eviction policy {eviction!r}: expected one of {', '.join(EVICTION_POLICIES)}")
        if max_memories is not None and max_memories < 1:
            raise StoreError(f"max_memories must be at least 1 (or None for no limit), got {max_memories}")
        if ttl_days is not None and not ttl_days > 0:
            raise StoreError(f"ttl_days must be positive (or None: memories never expire), got {ttl_days}")
        self.max_memories, self.eviction, self.ttl_days = max_memories, eviction, ttl_days
        self.utility = UtilityTable(self.root)
        # called with each deleted memory id, e.g. to drop a serving process's cached copy
        self._delete_listeners: list[Callable[[str], None]] = []
        self.url = url
        self.tenant, self.database = tenant, database
        self.headers = dict(headers or {})
        self.token_env, self.token_header = token_env, token_header
        self.model = model
        self.known_models = dict(known_models or {})
        self.hnsw = dict(hnsw or {})
        if self.hnsw.get("space", "cosine") != "cosine":
            raise StoreError("memory keys are compared by cosine similarity: hnsw.space must be 'cosine'")
        self.blobs = BlobStore(self.root / "blobs")
        self.client = client if client is not None else self._connect()
        self._cols: dict[str, tuple[_CollInfo, Any]] = {}

    @classmethod
    def from_config(cls, cfg: StoreConfig, model: ModelInfo | None = None, **kwargs: Any) -> ChromaMemoryStore:
        from elm_memory.store.location import resolve_store_path  # a copy made with model_copy skips validation

        kwargs.setdefault("hnsw", cfg.hnsw)
        server = {
            "tenant": cfg.tenant,
            "database": cfg.database,
            "headers": cfg.headers,
            "token_env": cfg.token_env,
            "token_header": cfg.token_header,
        }
        for name in ("max_memories", "eviction", "ttl_days"):  # getattr: configs built before these fields
            if hasattr(cfg, name):
                kwargs.setdefault(name, getattr(cfg, name))
        return cls(resolve_store_path(cfg.path), url=cfg.url, model=model, **{**server, **kwargs})

    def _connect(self) -> Any:
        import chromadb
        from chromadb.config import Settings

        settings = Settings(anonymized_telemetry=False)
        if self.url:
            return self._connect_server(settings)
        if (self.tenant, self.database) != (DEFAULT_TENANT, DEFAULT_DATABASE) or self.headers or self.token_env:
            raise StoreError("store.tenant, database, headers and token_env apply to a Chroma server: set store.url")
        try:
            (self.root / "chroma").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the memory store at {self.root}: {exc.strerror or exc}") from None
        with _chroma_errors(f"opening the store at {self.root}"):
            return chromadb.PersistentClient(path=str(self.root / "chroma"), settings=settings)

    def _connect_server(self, settings: Any) -> Any:
        import chromadb
        import chromadb.errors

        url = str(self.url)
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreError(f"store.url {self.url!r} is not an http(s)://host:port URL")
        port = parts.port or (443 if parts.scheme == "https" else 8000)
        if self.token_env:
            token = os.environ.get(self.token_env, "")
            if not token:
                raise StoreError(f"store.token_env names ${self.token_env}, which is not set (or empty)")
            if self.token_header.lower() in {h.lower() for h in self.headers}:
                raise StoreError(f"store.headers sets {self.token_header}, which the token from store.token_env uses")
            # chromadb's own token auth: it formats the header (Bearer or X-Chroma-Token) and keeps
            # the token in a SecretStr, out of reprs and logs
            settings.chroma_client_auth_provider = "chromadb.auth.token_authn.TokenAuthClientProvider"
            settings.chroma_client_auth_credentials = token
            settings.chroma_auth_token_transport_header = self.token_header
        where = f"the Chroma server at {self.url}"
        with _chroma_errors(f"connecting to {where}"):
            try:
                # the constructor looks the tenant and database up: a missing one fails here, not at first use
                return chromadb.HttpClient(
                    host=parts.hostname,
                    port=port,
                    ssl=parts.scheme == "https",
                    headers=dict(self.headers) or None,  # a copy: chromadb adds its own to the dict it gets
                    settings=settings,
                    tenant=self.tenant,
                    database=self.database,
                )
            except chromadb.errors.NotFoundError as exc:  # "Tenant [x] not found" / "Database [y] not found..."
                if str(exc).lower().startswith("tenant"):
                    missing = f"tenant {self.tenant!r} (store.tenant)"
                else:
                    missing = f"database {self.database!r} in tenant {self.tenant!r} (store.database)"
                raise StoreError(f"{where} has no {missing}; create it with chromadb's AdminClient") from None
            except (chromadb.errors.ChromaAuthError, chromadb.errors.AuthorizationError) as exc:
                raise StoreError(
                    f"{where} refused the credentials ({exc}); check store.token_env, store.token_header "
                    "and store.headers"
                ) from None

    def _batch_size(self) -> int:
        """Most rows one write may carry (the client's limit; 0: none known)."""
        with _chroma_errors("reading the Chroma batch limit"):
            n = int(self.client.get_max_batch_size())
        return max(n, 0)  # servers predating the pre-flight check report -1

    def _chunks(self, n: int) -> Iterator[slice]:
        """Slices of ``range(n)`` no longer than the client's batch limit."""
        size = self._batch_size() or max(n, 1)
        for start in range(0, n, size):
            yield slice(start, start + size)

    # ---- collections -------------------------------------------------------------------
    @staticmethod
    def _info(col: Any) -> _CollInfo | None:
        m = col.metadata or {}
        if m.get("elm_schema") != SCHEMA:
            return None
        return _CollInfo(
            col.name, m["model_fingerprint"], m["kind"], m["namespace"], int(m["hidden_size"]), int(m["dim"])
        )

    def _open(self, fingerprint: str, kind: str, namespace: str) -> tuple[_CollInfo, Any] | None:
        """The collection for (fingerprint, kind, namespace) if it exists."""
        name = collection_name(fingerprint, kind, namespace)
        if name in self._cols:
            return self._cols[name]
        import chromadb.errors

        try:
            with _chroma_errors(f"opening collection {name}"):
                try:
                    col = self.client.get_collection(name, embedding_function=None)
                except chromadb.errors.NotFoundError:
                    return None
        except StoreError as exc:  # older servers report a missing collection as a ValueError
            if "does not exist" in str(exc):
                return None
            raise
        return self._remember(col, fingerprint, kind, namespace)

    def hnsw_settings(self, kind: str) -> dict[str, Any]:
        """HNSW configuration for a new collection of ``kind``: defaults, per-kind tuning, then overrides."""
        return {**DEFAULT_HNSW, **KIND_HNSW.get(kind, {}), **self.hnsw}

    def _remember(self, col: Any, fingerprint: str, kind: str, namespace: str) -> tuple[_CollInfo, Any]:
        info = self._info(col)
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
            with _chroma_errors(f"updating the HNSW settings of {col.name}"):
                col.modify(configuration={"hnsw": change})

    def _create(self, fingerprint: str, kind: str, namespace: str, hidden_size: int, dim: int) -> tuple[_CollInfo, Any]:
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
            with _chroma_errors(f"creating collection {name}"):
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
    ) -> list[tuple[_CollInfo, Any]]:
        """ELM collections matching the filters (only the bound model's unless ``all_models``)."""
        fp = fingerprint if fingerprint is not None else (self.model.fingerprint if self.model else None)
        if all_models:
            fp = None
        with _chroma_errors("listing collections"):
            cols = self.client.list_collections()
        out = []
        for col in cols:
            info = self._info(col)
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
    def _rows(self, col: tuple[_CollInfo, Any], ids: Sequence[str] | None = None) -> list[_Row]:
        info, c = col
        out: list[_Row] = []
        with _chroma_errors(f"reading {info.name}"):
            if ids is not None:
                # chromadb 1.5 does not limit reads by id, but one request per id batch keeps an
                # import's lookups the size of its writes on any server
                ids = list(ids)
                for part in self._chunks(len(ids)):
                    res = c.get(ids=ids[part], include=["metadatas"])
                    out.extend(_Row(info, i, m or {}) for i, m in zip(res["ids"], res["metadatas"], strict=True))
                return out
            offset = 0
            while True:
                res = c.get(include=["metadatas"], limit=_PAGE, offset=offset)
                out.extend(_Row(info, i, m or {}) for i, m in zip(res["ids"], res["metadatas"], strict=True))
                if len(res["ids"]) < _PAGE:
                    return out
                offset += _PAGE

    def _upsert_rows(self, col: tuple[_CollInfo, Any], ids: list[str], vectors: np.ndarray, metas: list[dict]) -> None:
        """Write index rows (a crash test hook: everything before it is the blob write).

        A failure part-way leaves the earlier batches written: their blobs already are, so
        ``check(repair=True)`` (or putting again) completes the rest.
        """
        with _chroma_errors(f"writing to {col[0].name}"):
            for part in self._chunks(len(ids)):
                col[1].upsert(ids=ids[part], embeddings=vectors[part], metadatas=metas[part])

    def _delete_rows(self, col: tuple[_CollInfo, Any], ids: list[str]) -> None:
        with _chroma_errors(f"deleting from {col[0].name}"):
            for part in self._chunks(len(ids)):
                col[1].delete(ids=ids[part])

    # ---- MemoryStore: writes --------------------------------------------------------------
    def put(self, memory: LatentMemory) -> str:
        return self.put_many([memory])[0]

    def put_many(self, memories: Sequence[LatentMemory]) -> list[str]:
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
        batches: dict[str, tuple[tuple[_CollInfo, Any], list[str], list[np.ndarray], list[dict]]] = {}
        stale_blobs: set[str] = set()
        stale_rows: dict[str, tuple[tuple[_CollInfo, Any], list[str]]] = {}
        for m, sha in zip(memories, shas, strict=True):
            meta = m.meta
            previous = self._existing_rows(meta.model_fingerprint, meta.namespace, meta.id, list(m.keys))
            usage = _usage_by_kind(previous)
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
                b[3].append(_row_metadata(m, sha, *usage.get(kind, (0, 0.0))))
        for col, ids, vecs, metas in batches.values():
            self._upsert_rows(col, ids, np.stack(vecs).astype(np.float32), metas)
        for col, ids in stale_rows.values():
            self._delete_rows(col, ids)
        for sha in stale_blobs - set(shas):
            self.blobs.delete(sha)
        if self.ttl_days is not None or self.max_memories is not None:
            self._after_put({m.meta.namespace for m in memories}, [m.id for m in memories])
        return shas

    def _finish_pending(self, memory_ids: Sequence[str]) -> None:
        """Complete interrupted deletes of ids about to be written again: a later ``check --repair``
        must not delete the new version, and the old one's counters must not carry over."""
        for p in self.utility.pending(memory_ids=memory_ids):
            rows = [r for r in self._find(p.memory_id, p.namespace) if r.coll.fingerprint == p.fingerprint]
            if rows:
                self._delete_memories(_group(rows))
            else:
                for sha in p.blobs:
                    if not self._blobs_in_use(p.namespace, {sha}):
                        self.blobs.delete(sha)
                self.utility.forget(p.namespace, [p.memory_id])

    def _check_writable(self, memory: LatentMemory) -> None:
        if not isinstance(memory, LatentMemory):
            raise StoreError(f"can only store LatentMemory objects, got {type(memory).__name__}")
        memory.validate()  # again: meta and keys are mutable after construction
        ref = self._reference(memory.meta.model_fingerprint)
        if ref is not None:
            memory.check_compatible(ref)
            _check_key_dims(memory, ref)
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
        with _chroma_errors("listing collections"):
            listed = self.client.list_collections()
        cols = [(info, c) for c in listed if (info := self._info(c)) is not None]
        # with no model to check against (see _check_writable), the shapes this store already
        # indexed for the same model are the reference
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
        for col in cols:
            for r in self._rows(col, list(by_id)):
                m = by_id[r.id]
                if (r.coll.fingerprint, r.coll.namespace) != (m.meta.model_fingerprint, m.meta.namespace):
                    raise MemoryIdConflictError(
                        f"memory id {r.id} is already used in namespace {r.coll.namespace!r} "
                        f"(model {r.coll.fingerprint}); ids are unique per store"
                    )

    def _existing_rows(self, fingerprint: str, namespace: str, memory_id: str, kinds: Sequence[str]) -> list[_Row]:
        """Rows of a memory being re-put, looked up by collection name (no listing of all collections).

        Kinds checked: the memory's own, the registered ones and any seen by this process; a
        stale row of another kind is caught by ``check`` (its blob is gone after the put).
        """
        from elm_memory.registry import key_builders

        seen = {info.kind for info, _ in self._cols.values()}
        rows: list[_Row] = []
        for kind in sorted(set(kinds) | set(key_builders.names()) | seen):
            col = self._open(fingerprint, kind, namespace)
            if col is not None:
                rows.extend(self._rows(col, [memory_id]))
        return rows

    def delete(self, memory_id: str, namespace: str | None = None) -> bool:
        """Delete one memory: index rows, blob, counters (journalled: see the module docstring)."""
        rows = self._find(memory_id, namespace)
        if not rows:
            return False
        self._delete_memories(_group(rows))
        return True

    def delete_namespace(self, namespace: str) -> list[str]:
        """Delete every memory of ``namespace`` (every model's) and its collections; returns the ids."""
        validate_namespace(namespace)
        cols = self._collections(namespace=namespace, all_models=True)
        rows = [r for col in cols for r in self._rows(col)]
        self._delete_memories(_group(rows), drop=cols)
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
        import logging
        import sqlite3

        path = self.root / "chroma" / "chroma.sqlite3"
        try:
            conn = sqlite3.connect(path, timeout=10.0)
            try:
                conn.execute("VACUUM")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            logging.getLogger(__name__).warning("could not compact %s: %s", path, exc)
            return False
        return True

    def add_delete_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(memory_id)`` after each memory this store object deletes (caches drop copies)."""
        self._delete_listeners.append(listener)

    def _delete_memories(
        self, victims: Mapping[tuple[str, str, str], Sequence[_Row]], drop: Sequence[tuple[_CollInfo, Any]] = ()
    ) -> None:
        """Journal -> rows (or whole collections, ``drop``) -> blobs -> counters and journal.

        The journal entry goes first so that a crash after the rows went is finished by
        ``check --repair`` rather than undone (a blob without rows otherwise reads as an
        interrupted put). Rows go before the blob, so no row ever points at a missing blob.
        """
        if not victims:
            return
        now = time.time()
        self.utility.begin_deletes(
            [
                PendingDelete(ns, mid, fp, tuple(sorted({str(r.meta["blob"]) for r in rows if r.meta.get("blob")})), now)
                for (mid, fp, ns), rows in victims.items()
            ]
        )
        dropped = {info.name for info, _ in drop}
        by_col: dict[str, tuple[tuple[_CollInfo, Any], list[str]]] = {}
        for rows in victims.values():
            for r in rows:
                if r.coll.name not in dropped:
                    by_col.setdefault(r.coll.name, (self._open_info(r.coll), []))[1].append(r.id)
        for col, ids in by_col.values():
            self._delete_rows(col, ids)
        for info, _ in drop:
            with _chroma_errors(f"dropping collection {info.name}"):
                self.client.delete_collection(info.name)
            self._forget(info.name)
        shas_by_ns: dict[str, set[str]] = {}
        for (_, _, ns), rows in victims.items():
            shas_by_ns.setdefault(ns, set()).update(str(r.meta["blob"]) for r in rows if r.meta.get("blob"))
        for ns, shas in shas_by_ns.items():
            for sha in sorted(shas - self._blobs_in_use(ns, shas)):
                self.blobs.delete(sha)
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
                with _chroma_errors(f"reading {info.name}"):
                    res = c.get(where={"blob": {"$in": part}}, include=["metadatas"])
                used.update(str((m or {}).get("blob")) for m in res["metadatas"])
        return used & shas

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

    # ---- capacity and age -------------------------------------------------------------------
    def _expired(self, record: MemoryRecord, now: float, ttl_days: float | None = None) -> bool:
        ttl = self.ttl_days if ttl_days is None else ttl_days
        return ttl is not None and record.created_at < now - ttl * 86400.0

    def expire(self, namespace: str | None = None, *, ttl_days: float | None = None, now: float | None = None) -> list[str]:
        """Delete memories older than ``ttl_days`` (default: the store's); returns their ids."""
        ttl = self.ttl_days if ttl_days is None else ttl_days
        if ttl is None:
            raise StoreError("no TTL: set store.ttl_days (memories older than it expire)")
        now = time.time() if now is None else now
        cutoff = now - ttl * 86400.0
        victims: dict[tuple[str, str, str], list[_Row]] = {}
        for col in self._collections(namespace=namespace):
            with _chroma_errors(f"reading {col[0].name}"):
                res = col[1].get(where={"created_at": {"$lt": cutoff}}, include=["metadatas"])
            for mid, meta in zip(res["ids"], res["metadatas"], strict=True):
                victims.setdefault((mid, col[0].fingerprint, col[0].namespace), [])
        if victims:  # all rows of each expired memory, of every kind
            for key in list(victims):
                victims[key] = [r for r in self._find(key[0], key[2]) if r.coll.fingerprint == key[1]]
        self._delete_memories({k: v for k, v in victims.items() if v})
        return sorted(k[0] for k in victims)

    def evict(
        self, policy: str | None = None, keep: int | None = None, namespace: str | None = None, *,
        protect: Sequence[str] = (),
    ) -> list[str]:  # fmt: skip
        """Delete memories beyond ``keep`` per namespace (default ``max_memories``), by ``policy``
        (default ``eviction``); never one in ``protect``. Returns the evicted ids."""
        policy = self.eviction if policy is None else policy
        keep = self.max_memories if keep is None else keep
        if policy not in EVICTION_POLICIES:
            raise StoreError(f"unknown eviction policy {policy!r}: expected one of {', '.join(EVICTION_POLICIES)}")
        if keep is None:
            raise StoreError("nothing to keep to: pass keep=N or set store.max_memories")
        if keep < 0:
            raise StoreError(f"keep must be 0 or more, got {keep}")
        evicted: list[str] = []
        for ns in [namespace] if namespace is not None else self.namespaces():
            if not self._may_exceed(ns, keep):
                continue
            records = self.list(ns)
            excess = len(records) - keep
            if excess <= 0:
                continue
            util = self.utility_of(ns)
            order = sorted((r for r in records if r.id not in set(protect)), key=_eviction_key(policy, util))
            chosen = {r.id for r in order[:excess]}
            rows = [r for col in self._collections(namespace=ns) for r in self._rows(col, sorted(chosen))]
            self._delete_memories(_group(rows))
            evicted += sorted(chosen)
        return evicted

    def _may_exceed(self, namespace: str, keep: int) -> bool:
        """Cheap pre-check: row counts (no listing); a namespace with at most ``keep`` rows cannot exceed it."""
        with _chroma_errors("counting"):
            return sum(c.count() for _, c in self._collections(namespace=namespace)) > keep

    def _after_put(self, namespaces: set[str], protect: Sequence[str]) -> None:
        """Opportunistic expiry, then the capacity limit, for the namespaces a put wrote to."""
        for ns in sorted(namespaces):
            if self.ttl_days is not None:
                self.expire(ns)
            if self.max_memories is not None:
                self.evict(self.eviction, self.max_memories, ns, protect=protect)

    # ---- MemoryStore: reads ---------------------------------------------------------------
    def _bound(self) -> ModelInfo:
        if self.model is None:
            raise StoreError("this memory store is not bound to a model; open it with model=<ModelInfo> to query")
        return self.model

    def _find(self, memory_id: str, namespace: str | None) -> list[_Row]:
        rows: list[_Row] = []
        for col in self._collections(namespace=namespace):
            rows.extend(self._rows(col, [memory_id]))
        return rows

    def record(self, memory_id: str, namespace: str | None = None) -> MemoryRecord:
        """The index record of one memory (all its key kinds), without opening the blob."""
        rows = self._find(memory_id, namespace)
        if not rows:
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise MemoryNotFoundError(f"no memory {memory_id!r}{where} in {self.url or self.root}")
        [record] = self._with_usage([_record(rows)])
        return record

    def _with_usage(self, records: Sequence[MemoryRecord]) -> list[MemoryRecord]:
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

    def get(self, memory_id: str, namespace: str | None = None) -> LatentMemory:
        return self.load(self.record(memory_id, namespace))

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
    ) -> list[MemoryRecord]:
        """Records sorted by creation time (oldest first); reads index rows only."""
        by_id: dict[str, list[_Row]] = {}
        for col in self._collections(namespace=namespace, kind=kind):
            for r in self._rows(col):
                by_id.setdefault(r.id, []).append(r)
        records = sorted((_record(rows) for rows in by_id.values()), key=lambda r: (r.created_at, r.id))
        return self._with_usage(records[offset : None if limit is None else offset + limit])

    def namespaces(self) -> list[str]:
        return sorted({info.namespace for info, _ in self._collections()})

    def count(self, namespace: str | None = None, *, kind: str | None = None) -> int:
        """Rows of one kind (fast), or distinct memories over all kinds."""
        cols = self._collections(namespace=namespace, kind=kind)
        if kind is not None:
            with _chroma_errors("counting"):
                return sum(c.count() for _, c in cols)
        ids: set[str] = set()
        for info, c in cols:
            with _chroma_errors(f"reading {info.name}"):
                ids.update(c.get(include=[])["ids"])
        return len(ids)

    def query(self, kind: str, vector: torch.Tensor | np.ndarray, namespace: str, k: int = 1) -> list[StoreHit]:
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
                with _chroma_errors(f"querying {info.name}"):
                    res = col.query(query_embeddings=vec[None, :], n_results=k, include=["distances", "metadatas"])
                    if self.ttl_days is not None:
                        cutoff = time.time() - self.ttl_days * 86400.0
                        if any(float((m or {}).get("created_at", 0.0)) < cutoff for m in res["metadatas"][0]):
                            # only then the (slower, filtered) query: expired memories are never returned
                            res = col.query(
                                query_embeddings=vec[None, :], n_results=k, include=["distances", "metadatas"],
                                where={"created_at": {"$gte": cutoff}},
                            )  # fmt: skip
                break
            except StoreError as exc:  # collection deleted behind our cached handle
                if attempt or "does not exist" not in str(exc):
                    raise
                self._forget(info.name)
        hits = []
        for mid, dist, meta in zip(res["ids"][0], res["distances"][0], res["metadatas"][0], strict=True):
            hits.append(StoreHit(record=_record([_Row(info, mid, meta or {})]), score=1.0 - float(dist)))
        return hits

    # ---- consistency -----------------------------------------------------------------------
    def check(self, repair: bool = False, *, deep: bool = False, temp_grace_seconds: float = 600.0) -> CheckReport:
        """Find (and with ``repair`` fix) disagreements between blobs and rows, over the whole store.

        The blob is authoritative: missing or stale rows are rebuilt from it (this finishes
        an interrupted put), rows without a blob are dropped (this finishes an interrupted
        delete), older blobs of a re-put memory are removed. ``deep`` re-hashes every blob.
        Temp files younger than ``temp_grace_seconds`` may belong to a live writer and are kept.

        Memories are matched by (id, model, namespace), never by id alone: a repair must not
        pick one namespace's memory over another's that shares its id (stores written before
        ids were unique per store); such an id is reported in ``errors`` for a person to resolve.
        Empty collections are dropped on repair: an index keeps the shapes of its first memory,
        so one emptied of a wrong-shaped memory would otherwise refuse the model's own.
        """
        report = CheckReport(repaired=repair)
        pending = {(p.memory_id, p.fingerprint, p.namespace): p for p in self.utility.pending()}
        cols = self._collections(all_models=True)
        rows_by_id: dict[tuple[str, str, str], list[_Row]] = {}
        for col in cols:
            for r in self._rows(col):
                rows_by_id.setdefault((r.id, r.coll.fingerprint, r.coll.namespace), []).append(r)
                report.rows += 1
        blobs_by_id: dict[tuple[str, str, str], list[tuple[str, MemoryMeta, list[str], float]]] = {}
        for sha in list(self.blobs):
            report.blobs += 1
            try:
                meta, kinds = _blob_meta(self.blobs.read_header(sha))
                if deep:
                    self.blobs.get(sha)
                mtime = self.blobs.path(sha).stat().st_mtime
            except (MemoryFormatError, MissingBlobError, OSError, ValueError, KeyError):
                report.corrupt_blobs.append(sha)
                if repair:
                    self.blobs.delete(sha)
                continue
            group = (meta.id, meta.model_fingerprint, meta.namespace)
            blobs_by_id.setdefault(group, []).append((sha, meta, kinds, mtime))
        report.temp_files = [str(p) for p in self.blobs.temp_files(older_than=temp_grace_seconds)]
        if repair:
            for p in report.temp_files:
                Path(p).unlink(missing_ok=True)

        owners: dict[str, list[str]] = {}
        for mid, fp, ns in blobs_by_id:
            owners.setdefault(mid, []).append(f"{ns!r} (model {fp})")
        for mid, where in sorted(owners.items()):
            if len(where) > 1:
                report.errors.append(
                    f"{mid}: id used by {len(where)} memories, in {', '.join(sorted(where))}; "
                    f"delete all but one with `elm memories delete {mid} --namespace NS`"
                )
        for group, p in sorted(pending.items()):
            # an interrupted delete: finish it (its blob without rows is not an interrupted put)
            rows, blobs = rows_by_id.pop(group, []), blobs_by_id.pop(group, [])
            report.pending_deletes.append(f"{p.namespace}/{p.memory_id}")
            if not rows:
                report.orphan_blobs.extend(sha for sha, *_ in blobs)
            if repair:
                for r in rows:
                    self._delete_rows(self._open_info(r.coll), [r.id])
                for sha in sorted({sha for sha, *_ in blobs} | set(p.blobs)):
                    self.blobs.delete(sha)
                self.utility.forget(p.namespace, [p.memory_id])
                for listener in self._delete_listeners:
                    listener(p.memory_id)
        live = {(ns, mid) for mid, _, ns in set(rows_by_id) | set(blobs_by_id)}
        live |= {(p.namespace, p.memory_id) for p in pending.values()}  # handled above
        for ns, mid in sorted(self.utility.get()):
            if (ns, mid) not in live:
                report.orphan_utility.append(f"{ns}/{mid}")
        if repair:
            by_ns: dict[str, list[str]] = {}
            for item in report.orphan_utility:
                ns, _, mid = item.rpartition("/")
                by_ns.setdefault(ns, []).append(mid)
            for ns, ids in by_ns.items():
                self.utility.forget(ns, ids)
        for group in sorted(set(rows_by_id) | set(blobs_by_id)):
            report.memories += 1
            mid = group[0]
            rows, blobs = rows_by_id.get(group, []), blobs_by_id.get(group, [])
            if not blobs:
                report.orphan_rows.extend(f"{r.coll.name}/{r.id}" for r in rows)
                if repair:
                    for r in rows:
                        self._delete_rows(self._open_info(r.coll), [r.id])
                continue
            # canonical blob: the one most rows point to, then the newest
            refs = {sha: sum(1 for r in rows if r.meta.get("blob") == sha) for sha, *_ in blobs}
            sha, meta, kinds, _ = max(blobs, key=lambda b: (refs[b[0]], b[3]))
            for other, *_ in blobs:
                if other != sha:
                    report.superseded_blobs.append(other)
                    if repair:
                        self.blobs.delete(other)
            good = {
                r.coll.kind
                for r in rows
                if r.meta.get("blob") == sha
                and r.coll.kind in kinds
                and (r.coll.fingerprint, r.coll.namespace) == (meta.model_fingerprint, meta.namespace)
            }
            bad = [
                r
                for r in rows
                if r.coll.kind not in good
                or (r.coll.fingerprint, r.coll.namespace) != (meta.model_fingerprint, meta.namespace)
            ]
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
        for info, c in cols:  # after the repairs above, which may have emptied some
            with _chroma_errors(f"counting {info.name}"):
                empty = c.count() == 0
            if empty:
                report.empty_collections.append(info.name)
                if repair:
                    with _chroma_errors(f"dropping empty collection {info.name}"):
                        self.client.delete_collection(info.name)
                    self._forget(info.name)
        return report

    def _open_info(self, info: _CollInfo) -> tuple[_CollInfo, Any]:
        found = self._open(info.fingerprint, info.kind, info.namespace)
        if found is None:
            raise StoreError(f"collection {info.name} disappeared during the check")
        return found

    def _reindex(self, sha: str, kinds: Sequence[str], old_rows: Sequence[_Row]) -> None:
        """Rebuild the rows of ``kinds`` from blob ``sha``, keeping usage counters."""
        memory = LatentMemory.from_bytes(self.blobs.get(sha))
        meta = memory.meta
        usage = _usage_by_kind(old_rows)
        for kind in kinds:
            key = memory.keys[kind]
            col = self._create(meta.model_fingerprint, kind, meta.namespace, meta.hidden_size, key.numel())
            row = _row_metadata(memory, sha, *usage.get(kind, (0, 0.0)))
            self._upsert_rows(col, [meta.id], key.numpy()[None, :].astype(np.float32), [row])

