"""Capacity and age: evicting down to ``max_memories`` per namespace, expiring after ``ttl_days``.

A put first removes its namespaces' expired memories, then evicts down to ``max_memories``
(never a memory the put just wrote); ``elm memories evict`` runs the same on demand.
Expired memories are never returned by ``query`` (see the store). Both delete through the
journal (:mod:`elm_memory.store.chroma.deletes`), so a crash mid-eviction is repairable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elm_memory.errors import StoreError
from elm_memory.store.base import MemoryRecord
from elm_memory.store.chroma.connection import chroma_errors
from elm_memory.store.chroma.deletes import DeleteJournal
from elm_memory.store.chroma.rows import IndexRow, MemoryKey, group_by_memory
from elm_memory.store.utility import Utility

#: Eviction policies, by what goes first: least recently used (never used: by creation time),
#: lowest Laplace-smoothed utility (ties: least recently used), oldest creation time.
EVICTION_POLICIES = ("lru", "utility", "oldest")


def check_policy(policy: str) -> str:
    if policy not in EVICTION_POLICIES:
        raise StoreError(f"unknown eviction policy {policy!r}: expected one of {', '.join(EVICTION_POLICIES)}")
    return policy


def eviction_key(policy: str, util: Mapping[str, Utility]) -> Callable[[MemoryRecord], tuple[Any, ...]]:
    """Sort key putting the memory to evict first (see ``EVICTION_POLICIES``)."""

    def last_use(r: MemoryRecord) -> float:
        return max(r.last_used_at, r.created_at)

    if policy == "oldest":
        return lambda r: (r.created_at, r.id)
    if policy == "lru":
        return lambda r: (last_use(r), r.created_at, r.id)
    return lambda r: (util[r.id].smoothed_utility if r.id in util else 0.5, last_use(r), r.id)


class CapacityLimits(DeleteJournal):
    """``max_memories`` / ``eviction`` / ``ttl_days`` of ``StoreConfig``, applied after each put."""

    max_memories: int | None
    eviction: str
    ttl_days: float | None

    def expire(
        self, namespace: str | None = None, *, ttl_days: float | None = None, now: float | None = None
    ) -> list[str]:
        """Delete memories older than ``ttl_days`` (default: the store's); returns their ids."""
        ttl = self.ttl_days if ttl_days is None else ttl_days
        if ttl is None:
            raise StoreError("no TTL: set store.ttl_days (memories older than it expire)")
        now = time.time() if now is None else now
        cutoff = now - ttl * 86400.0
        victims: dict[MemoryKey, list[IndexRow]] = {}
        for col in self._collections(namespace=namespace):
            with chroma_errors(f"reading {col[0].name}"):
                res = col[1].get(where={"created_at": {"$lt": cutoff}}, include=["metadatas"])
            for mid in res["ids"]:
                victims.setdefault((mid, col[0].fingerprint, col[0].namespace), [])
        if victims:  # all rows of each expired memory, of every kind
            for key in list(victims):
                victims[key] = [r for r in self._find(key[0], key[2]) if r.coll.fingerprint == key[1]]
        self._delete_memories({k: v for k, v in victims.items() if v})
        return sorted(k[0] for k in victims)

    def evict(
        self,
        policy: str | None = None,
        keep: int | None = None,
        namespace: str | None = None,
        *,
        protect: Sequence[str] = (),
    ) -> list[str]:
        """Delete memories beyond ``keep`` per namespace (default ``max_memories``), by ``policy``
        (default ``eviction``); never one in ``protect``. Returns the evicted ids."""
        policy = check_policy(self.eviction if policy is None else policy)
        keep = self.max_memories if keep is None else keep
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
            order = sorted((r for r in records if r.id not in set(protect)), key=eviction_key(policy, util))
            chosen = {r.id for r in order[:excess]}
            rows = [r for col in self._collections(namespace=ns) for r in self._rows(col, sorted(chosen))]
            self._delete_memories(group_by_memory(rows))
            evicted += sorted(chosen)
        return evicted

    def _may_exceed(self, namespace: str, keep: int) -> bool:
        """Cheap pre-check: row counts (no listing); a namespace with at most ``keep`` rows cannot exceed it."""
        with chroma_errors("counting"):
            return sum(c.count() for _, c in self._collections(namespace=namespace)) > keep

    def _after_put(self, namespaces: set[str], protect: Sequence[str]) -> None:
        """Opportunistic expiry, then the capacity limit, for the namespaces a put wrote to."""
        for ns in sorted(namespaces):
            if self.ttl_days is not None:
                self.expire(ns)
            if self.max_memories is not None:
                self.evict(self.eviction, self.max_memories, ns, protect=protect)
