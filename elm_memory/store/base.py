"""The store contract: the :class:`MemoryStore` protocol, :class:`MemoryStoreBase` and their records.

A store keeps two things per memory: the memory itself (soft prompt, keys, metadata; a
safetensors blob) and one index row per key kind (the key vector plus a small metadata
record). The blob is the source of truth: an index row is only a way to find it, and
can always be rebuilt from it (``check(repair=True)``).

Namespaces are hard boundaries: a query names exactly one namespace and can never see
a memory filed under another.
"""

from __future__ import annotations

import builtins  # annotations below a method named `list` must say builtins.list
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from elm_memory.errors import AmbiguousMemoryIdError, ELMError, MemoryNotFoundError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import MIN_ID_PREFIX, SHORT_ID_CHARS

if TYPE_CHECKING:
    from elm_memory.store.utility import Utility


@dataclass(frozen=True)
class MemoryRecord:
    """What the index knows about a memory without opening its blob."""

    id: str
    namespace: str
    model_fingerprint: str
    kinds: tuple[str, ...]
    blob: str  # sha256 of the safetensors bytes
    question: str  # preview (first characters) of the question
    question_hash: str
    created_at: float
    usage: int  # times retrieved, summed over key kinds
    last_used_at: float
    no_consensus: bool
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoreHit:
    """One nearest-neighbour result: cosine similarity and the row it came from."""

    record: MemoryRecord
    score: float


@dataclass
class CheckReport:
    """Inconsistencies between blobs and index rows, and what ``repair`` did about them.

    ``reindexed``: memories whose blob had missing/stale rows (an interrupted put): rows
    rebuilt from the blob. ``orphan_rows``: rows whose blob is gone (an interrupted
    delete, or a lost file): rows removed. ``superseded_blobs``: older versions of a
    memory that a newer blob replaced. ``corrupt_blobs``: unreadable or hash-mismatched
    files. ``errors``: memories a repair could not fix (e.g. a key that no longer fits its index).
    ``empty_collections``: indexes without rows (normal after deletes, so not a problem for
    ``ok``); a repair drops them so the next write recreates them with its own shapes.
    ``pending_deletes``: memories ("namespace/id") whose journalled delete was interrupted: a
    repair finishes it. ``orphan_blobs``: blobs of such memories whose rows are already gone
    (removed on repair; never reindexed). ``orphan_utility``: counter rows ("namespace/id")
    of memories that no longer exist (removed on repair). ``interrupted_merges``: merged memories
    ("namespace/id") whose members are still present (a merge a crash interrupted after the merged
    memory was written): a repair finishes the merge (members' counters added, members deleted).
    """

    blobs: int = 0
    rows: int = 0
    memories: int = 0
    reindexed: list[str] = field(default_factory=list)  # memory ids
    orphan_rows: list[str] = field(default_factory=list)  # "collection/id"
    superseded_blobs: list[str] = field(default_factory=list)  # sha256
    corrupt_blobs: list[str] = field(default_factory=list)  # sha256
    temp_files: list[str] = field(default_factory=list)  # paths
    errors: list[str] = field(default_factory=list)  # "id: message" for memories a repair could not fix
    empty_collections: list[str] = field(default_factory=list)  # collection names (dropped by a repair)
    pending_deletes: list[str] = field(default_factory=list)  # "namespace/id"
    orphan_blobs: list[str] = field(default_factory=list)  # sha256
    orphan_utility: list[str] = field(default_factory=list)  # "namespace/id"
    interrupted_merges: list[str] = field(default_factory=list)  # "namespace/id" of the merged memory
    repaired: bool = False

    @property
    def ok(self) -> bool:
        return not (
            self.reindexed
            or self.orphan_rows
            or self.superseded_blobs
            or self.corrupt_blobs
            or self.temp_files
            or self.errors
            or self.pending_deletes
            or self.orphan_blobs
            or self.orphan_utility
            or self.interrupted_merges
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


_PREFIX_RE = re.compile(rf"[0-9a-f]{{{MIN_ID_PREFIX},64}}")
_SHOWN_MATCHES = 10  # an ambiguous prefix's error names at most this many memories


def id_prefix(prefix: str) -> str:
    """A memory id or its prefix as typed (any case), lowercased; :class:`MemoryNotFoundError` if it cannot be one."""
    typed = prefix.strip().lower() if isinstance(prefix, str) else ""
    if not _PREFIX_RE.fullmatch(typed):
        raise MemoryNotFoundError(
            f"no memory {str(prefix)[:70]!r}: give a memory id or its first {MIN_ID_PREFIX} or more hex characters"
        )
    return typed


def match_prefixes(prefixes: Sequence[str], candidates: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Each prefix's memory id among ``candidates`` ((id, namespace) pairs; an id may repeat): an exact id
    wins, else the one id starting with it. A prefix nothing starts with is absent from the result; one that
    several ids start with raises :class:`AmbiguousMemoryIdError` naming them."""
    wanted = {id_prefix(p) for p in prefixes}
    found: dict[str, dict[str, str]] = {p: {} for p in wanted}
    for memory_id, namespace in candidates:
        for p in wanted:
            if memory_id.startswith(p):
                found[p][memory_id] = namespace
    out: dict[str, str] = {}
    for p in sorted(wanted):
        ids = found[p]
        if p in ids or len(ids) == 1:
            out[p] = p if p in ids else next(iter(ids))
        elif ids:
            shown = _distinct_prefixes(sorted(ids))
            named = ", ".join(f"{shown[i]} in {ids[i]!r}" for i in sorted(ids)[:_SHOWN_MATCHES])
            more = f" and {len(ids) - _SHOWN_MATCHES} more" if len(ids) > _SHOWN_MATCHES else ""
            raise AmbiguousMemoryIdError(
                f"memory id {p!r} is ambiguous: {len(ids)} memories start with it: {named}{more}; give more characters",
                sorted(ids),
            )
    return out


def _distinct_prefixes(ids: Sequence[str]) -> dict[str, str]:
    """Each of sorted ``ids`` at the short length, or longer where that is what tells it from its neighbours."""
    out = {}
    for i, mid in enumerate(ids):
        n = SHORT_ID_CHARS
        for other in (ids[i - 1] if i else "", ids[i + 1] if i + 1 < len(ids) else ""):
            common = next((k for k, (a, b) in enumerate(zip(mid, other, strict=False)) if a != b), len(other))
            n = max(n, common + 1)
        out[mid] = mid[:n]
    return out


@runtime_checkable
class MemoryStore(Protocol):
    """The primitive operations every memory store implements (the rest: :class:`MemoryStoreBase`).

    A plugin store (registered under ``elm_memory.stores``) subclasses :class:`MemoryStoreBase`
    and implements exactly these six: write (``put_many``), enumerate (``list``), read
    (``load``), remove (``delete``), search (``query``) and count a retrieval
    (``record_usage``). Callers may rely on every method of :class:`MemoryStoreBase`.
    """

    def put_many(self, memories: Sequence[LatentMemory]) -> builtins.list[str]:
        """Store the memories and index every key in ``memory.keys``; returns the blob names."""
        ...

    def list(
        self, namespace: str | None = None, *, kind: str | None = None, limit: int | None = None, offset: int = 0
    ) -> builtins.list[MemoryRecord]:
        """Records sorted by creation time (oldest first), all namespaces when ``namespace`` is None."""
        ...

    def load(self, record: MemoryRecord) -> LatentMemory:
        """The memory a record (e.g. a query hit) points to, validated against the record."""
        ...

    def delete(self, memory_id: str, namespace: str | None = None) -> bool:
        """Remove one memory; False when there is none."""
        ...

    def query(self, kind: str, vector: torch.Tensor, namespace: str, k: int = 1) -> builtins.list[StoreHit]:
        """Top-``k`` rows of ``namespace`` by cosine similarity to ``vector`` (best first)."""
        ...

    def record_usage(self, kind: str, namespace: str, memory_ids: Sequence[str]) -> None:
        """Count one retrieval for each memory (its usage counter and last-used time)."""
        ...


class MemoryStoreBase(ABC):
    """A :class:`MemoryStore` with every other store method derived from its six primitives.

    Modelled on LangGraph's ``BaseStore``: a subclass implements the abstract methods
    (``put_many``, ``list``, ``load``, ``delete``, ``query``, ``record_usage``) and gets
    ``put``, ``get``, ``record``, ``namespaces``, ``count`` and ``check`` built on them, plus
    the optional utility counters (``record_outcome``, ``record_ground_truth``,
    ``utility_of``), which by default keep nothing. The derived versions are correct but
    read every record; a store with an index overrides them (the Chroma store does).
    """

    # ---- primitives: what a store implements ----------------------------------------------------
    @abstractmethod
    def put_many(self, memories: Sequence[LatentMemory]) -> builtins.list[str]: ...

    @abstractmethod
    def list(
        self, namespace: str | None = None, *, kind: str | None = None, limit: int | None = None, offset: int = 0
    ) -> builtins.list[MemoryRecord]: ...

    @abstractmethod
    def load(self, record: MemoryRecord) -> LatentMemory: ...

    @abstractmethod
    def delete(self, memory_id: str, namespace: str | None = None) -> bool: ...

    @abstractmethod
    def query(self, kind: str, vector: torch.Tensor, namespace: str, k: int = 1) -> builtins.list[StoreHit]: ...

    @abstractmethod
    def record_usage(self, kind: str, namespace: str, memory_ids: Sequence[str]) -> None: ...

    # ---- derived ----------------------------------------------------------------------------
    def put(self, memory: LatentMemory) -> str:
        """Store one memory; returns its blob name."""
        return self.put_many([memory])[0]

    def record(self, memory_id: str, namespace: str | None = None) -> MemoryRecord:
        """The record of one memory, or :class:`MemoryNotFoundError`."""
        for r in self.list(namespace):
            if r.id == memory_id:
                return r
        where = f" in namespace {namespace!r}" if namespace is not None else ""
        raise MemoryNotFoundError(f"no memory {memory_id!r}{where}")

    def resolve_ids(
        self, prefixes: Sequence[str], namespace: str | None = None, *, missing_ok: bool = False
    ) -> builtins.list[str | None]:
        """The full id of each shortened id (a unique prefix, at least 4 hex characters, as git takes short
        hashes), in order. A prefix several memories start with raises :class:`AmbiguousMemoryIdError`; one
        nothing starts with raises :class:`MemoryNotFoundError` (``None`` in its place with ``missing_ok``)."""
        found = match_prefixes(prefixes, self._ids_matching([id_prefix(p) for p in prefixes], namespace))
        out = [found.get(id_prefix(p)) for p in prefixes]
        if not missing_ok and None in out:
            unknown = prefixes[out.index(None)]
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise MemoryNotFoundError(f"no memory {unknown!r}{where} (no memory id starts with it)")
        return out

    def resolve_id(self, prefix: str, namespace: str | None = None) -> str:
        """The full id of one shortened id (see :meth:`resolve_ids`)."""
        [memory_id] = self.resolve_ids([prefix], namespace)
        assert memory_id is not None
        return memory_id

    def _ids_matching(self, prefixes: Sequence[str], namespace: str | None) -> Iterable[tuple[str, str]]:
        """(id, namespace) of memories whose id may start with one of ``prefixes`` (lowercase hex); a
        superset is fine. Reads every record here; a store with an index reads ids only (Chroma)."""
        return ((r.id, r.namespace) for r in self.list(namespace))

    def get(self, memory_id: str, namespace: str | None = None) -> LatentMemory:
        """The validated memory, or :class:`MemoryNotFoundError`."""
        return self.load(self.record(memory_id, namespace))

    def namespaces(self) -> builtins.list[str]:
        """Every namespace holding at least one memory, sorted."""
        return sorted({r.namespace for r in self.list()})

    def count(self, namespace: str | None = None, *, kind: str | None = None) -> int:
        """Memories (of one key kind, if given)."""
        return len(self.list(namespace, kind=kind))

    def check(self, repair: bool = False) -> CheckReport:
        """Every listed memory must load; one that does not is reported in ``errors`` (no repair)."""
        report = CheckReport(repaired=repair)
        for r in self.list():
            report.memories += 1
            try:
                self.load(r)
            except ELMError as exc:  # missing, corrupt or incompatible
                report.errors.append(f"{r.id}: {exc}")
        return report

    # ---- optional counters (default: not kept) -----------------------------------------------
    def record_outcome(self, namespace: str, memory_id: str, outcome: str, similarity: float | None = None) -> None:
        """Count what an answer did with the memory it used: ``agree``, ``won``, ``lost`` or ``unjudged``."""
        return None

    def record_ground_truth(self, namespace: str, memory_id: str, correct: bool) -> None:
        """Count an answer that used the memory as right or wrong against a gold answer (evaluation runs)."""
        return None

    def utility_of(self, namespace: str, memory_ids: Sequence[str] | None = None) -> dict[str, Utility]:
        """Counters of ``namespace``'s memories by id (a memory never counted is absent)."""
        return {}
