"""What the Chroma index holds: collection names and metadata, index rows, and records built from them.

**One collection per (model fingerprint, key kind, namespace)**, cosine space. Names are
``elm-<fp8>-<kind>-<hash12>`` (Chroma allows 3-63 chars of ``[a-zA-Z0-9._-]``); the exact
fingerprint, kind, namespace, hidden size and key dimension are in the collection metadata
and verified on open.

Rows: id = memory id, embedding = the key, metadata = namespace, created time, question
hash and preview, the blob's sha256, training statistics, and the usage counter (times
retrieved) with the last-used time. Pure data and conversions: no client here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elm_memory.errors import MemoryFormatError
from elm_memory.memory import LatentMemory, MemoryMeta
from elm_memory.store.base import MemoryRecord

#: Collection metadata format; collections with another value are not this store's.
SCHEMA = 1
QUESTION_PREVIEW = 200


def _slug(text: str, n: int) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:n].strip("-") or "k"


def collection_name(fingerprint: str, kind: str, namespace: str) -> str:
    """Deterministic Chroma collection name for one (model, key kind, namespace)."""
    digest = hashlib.sha256(f"{fingerprint}\x00{kind}\x00{namespace}".encode()).hexdigest()[:12]
    return f"elm-{_slug(fingerprint, 8)}-{_slug(kind, 16)}-{digest}"


@dataclass(frozen=True)
class CollectionInfo:
    """What a collection indexes, read from its metadata."""

    name: str
    fingerprint: str
    kind: str
    namespace: str
    hidden_size: int
    dim: int

    @staticmethod
    def of(col: Any) -> CollectionInfo | None:
        """The info of a chromadb collection, or None for one this store did not create."""
        m = col.metadata or {}
        if m.get("elm_schema") != SCHEMA:
            return None
        return CollectionInfo(
            col.name, m["model_fingerprint"], m["kind"], m["namespace"], int(m["hidden_size"]), int(m["dim"])
        )


@dataclass(frozen=True)
class IndexRow:
    """One row of one collection: a memory's key of one kind (the vector itself is not read)."""

    coll: CollectionInfo
    id: str
    meta: Mapping[str, Any]


#: The key a memory's rows are grouped by: (memory id, model fingerprint, namespace).
MemoryKey = tuple[str, str, str]


def row_metadata(memory: LatentMemory, blob: str, usage: int = 0, last_used_at: float = 0.0) -> dict[str, Any]:
    """The metadata of a memory's index rows (the same for each key kind, but for usage)."""
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
    if memory.kind != "soft_prompt":  # soft-prompt rows stay as they were; the retriever reads a missing kind so
        meta["memory_kind"] = memory.kind
    return meta


def record_from_rows(rows: Sequence[IndexRow]) -> MemoryRecord:
    """Merge one memory's rows (one per key kind) into a record."""
    first = rows[0].meta
    stats = {
        k: v
        for k, v in first.items()
        if k.startswith("train_") or k in ("majority_share", "majority_answer", "memory_kind")
    }
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


def usage_by_kind(rows: Sequence[IndexRow]) -> dict[str, tuple[int, float]]:
    """Usage counters to carry over when rows are rewritten."""
    return {r.coll.kind: (int(r.meta.get("usage", 0)), float(r.meta.get("last_used_at", 0.0))) for r in rows}


def group_by_memory(rows: Sequence[IndexRow]) -> dict[MemoryKey, list[IndexRow]]:
    """Rows by the memory they index: (id, model fingerprint, namespace)."""
    out: dict[MemoryKey, list[IndexRow]] = {}
    for r in rows:
        out.setdefault((r.id, r.coll.fingerprint, r.coll.namespace), []).append(r)
    return out


def blob_meta(header: Mapping[str, Any]) -> tuple[MemoryMeta, list[str]]:
    """Memory metadata and key kinds from a blob's safetensors header."""
    raw = (header.get("__metadata__") or {}).get("elm_memory")
    if raw is None:
        raise MemoryFormatError("blob has no elm_memory metadata")
    kinds = sorted(name[4:] for name in header if name.startswith("key."))
    return MemoryMeta.from_json(raw), kinds
