"""Merging near-duplicate memories (``elm memories merge``): clusters of keys, one memory per cluster.

**Clusters.** Inside one collection (one model, one key kind, one namespace: memories of
different models or namespaces are never compared), two memories are near-duplicates when the
cosine of their keys is at least ``threshold``. Clusters are complete-link: every pair in a
cluster is above the threshold (a chain a~b~c with a, c apart does not make one cluster).
Greedy and deterministic: the oldest unassigned memory opens a cluster and takes its
unassigned neighbours, most similar first, each only if it is near every member so far.

**Merged memory.** ``average``: the mean of the members' soft prompts. ``train`` (needs the
model; :mod:`elm_memory.training.merging`): a brief GRPO run on the members' questions from the
mean of their initial prompts. Either way its keys combine the members' (:func:`combine_keys`),
its question is the oldest member's, its ``created_at`` the youngest member's (merging does not
reset TTL or ``oldest`` eviction), and ``merged_from`` / ``merge_strategy`` record the
provenance. The members' utility counters are summed into it (usage, outcomes, gold grades;
the latest use), so ``utility`` eviction and the ``min_utility`` gate see their whole history.

The store commits each merge crash-safely (:mod:`elm_memory.store.chroma.merges`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from elm_memory.errors import StoreError
from elm_memory.memory import LatentMemory
from elm_memory.memory.merge import (  # re-exported: the merge math's old home
    average_memory,
    build_merged,
    combine_keys,
    common_kinds,
    merged_stats,
    require_soft_prompts,
)

__all__ = [  # the merge math lives in elm_memory.memory.merge; its names stay importable from here
    "DEFAULT_THRESHOLD",
    "STRATEGIES",
    "Cluster",
    "KeyCollectionInfo",
    "MergeBuilder",
    "MergeOutcome",
    "MergeableStore",
    "average_memory",
    "build_merged",
    "check_threshold",
    "cluster_keys",
    "combine_keys",
    "common_kinds",
    "find_clusters",
    "merge_clusters",
    "merge_namespace",
    "merged_stats",
    "neighbours",
    "require_soft_prompts",
]

#: Default cosine threshold. Measured on the default model's input keys (mean question embeddings) of
#: 60 synth-arith questions: rewordings of one question (a trailing space, "Please answer: ...",
#: "... Show your work.") score 0.995-0.999 against it; questions of one template with other
#: numbers have median 0.938 (12 of 120 pairs reach 0.99); different templates at most 0.935.
#: So 0.99 joins rewordings and only the closest same-template variants.
DEFAULT_THRESHOLD = 0.99
STRATEGIES = ("average", "train")
_BLOCK = 1024

#: Builds the merged memory of one cluster's members (oldest first).
MergeBuilder = Callable[[Sequence[LatentMemory]], LatentMemory]


class KeyCollectionInfo(Protocol):
    """What a key collection is filed under: one model, one key kind, one namespace."""

    @property
    def namespace(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def kind(self) -> str: ...


class MergeableStore(Protocol):
    """What merging needs of a store (``ChromaMemoryStore`` is one): its key collections and their
    vectors to cluster, the members to read and a crash-safe commit of each merged memory."""

    def key_collections(self, kind: str, namespace: str | None = None) -> Sequence[tuple[KeyCollectionInfo, Any]]: ...
    def key_matrix(self, col: Any) -> tuple[list[str], list[float], np.ndarray]: ...
    def get(self, memory_id: str, namespace: str | None = None) -> LatentMemory: ...
    def commit_merge(self, merged: LatentMemory) -> list[str]: ...


@dataclass(frozen=True)
class Cluster:
    """Near-duplicate memories of one model, key kind and namespace (ids oldest first)."""

    namespace: str
    fingerprint: str
    kind: str
    ids: tuple[str, ...]
    min_similarity: float  # the least similar pair

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MergeOutcome:
    cluster: Cluster
    merged_id: str
    deleted: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster.to_dict(), "merged_id": self.merged_id, "deleted": list(self.deleted)}


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise StoreError(f"merge threshold must be a cosine in (0, 1], got {threshold!r}")
    return float(threshold)


def neighbours(matrix: np.ndarray, threshold: float) -> list[dict[int, float]]:
    """For each row, the other rows whose cosine with it is at least ``threshold`` (blockwise: memory
    stays O(block x n) however many keys)."""
    x = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.maximum(norms, 1e-12)
    out: list[dict[int, float]] = [{} for _ in range(len(x))]
    for start in range(0, len(x), _BLOCK):
        sims = x[start : start + _BLOCK] @ x.T
        rows, cols = np.nonzero(sims >= threshold)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            i = start + r
            if i != c:
                out[i][c] = float(sims[r, c])
    return out


def cluster_keys(matrix: np.ndarray, threshold: float) -> list[tuple[list[int], float]]:
    """Complete-link clusters (row indices, rows in the order given, e.g. oldest first) of at least two
    rows, each with its least similar pair's cosine. See the module docstring."""
    nb = neighbours(matrix, check_threshold(threshold))
    assigned: set[int] = set()
    clusters: list[tuple[list[int], float]] = []
    for i in range(len(nb)):
        if i in assigned:
            continue
        members = [i]
        for j in sorted((j for j in nb[i] if j not in assigned), key=lambda j: (-nb[i][j], j)):
            if all(j in nb[m] for m in members):
                members.append(j)
        if len(members) > 1:
            assigned.update(members)
            members.sort()
            least = min(nb[a][b] for a in members for b in members if a < b)
            clusters.append((members, least))
    return clusters


def find_clusters(
    store: MergeableStore, *, namespace: str | None = None, kind: str = "input", threshold: float = DEFAULT_THRESHOLD
) -> list[Cluster]:
    """Near-duplicate clusters in each collection of key ``kind`` (one namespace, or all)."""
    threshold = check_threshold(threshold)
    out: list[Cluster] = []
    for col in store.key_collections(kind, namespace):
        info = col[0]
        ids, _, matrix = store.key_matrix(col)
        for rows, least in cluster_keys(matrix, threshold):
            out.append(Cluster(info.namespace, info.fingerprint, info.kind, tuple(ids[r] for r in rows), least))
    return out


# ---- running a merge --------------------------------------------------------------------------


def merge_clusters(
    store: MergeableStore, clusters: Sequence[Cluster], build: MergeBuilder = average_memory
) -> list[MergeOutcome]:
    """Build and commit one merged memory per cluster (each committed before the next is built)."""
    out: list[MergeOutcome] = []
    for c in clusters:
        members = [store.get(mid, c.namespace) for mid in c.ids]
        members.sort(key=lambda m: (m.meta.created_at, m.id))
        merged = build(members)
        deleted = store.commit_merge(merged)
        out.append(MergeOutcome(c, merged.id, tuple(deleted)))
    return out


def merge_namespace(
    store: MergeableStore,
    *,
    namespace: str | None = None,
    kind: str = "input",
    threshold: float = DEFAULT_THRESHOLD,
    build: MergeBuilder = average_memory,
) -> list[MergeOutcome]:
    """Find the clusters and merge each (``elm memories merge`` without ``--dry-run``)."""
    return merge_clusters(store, find_clusters(store, namespace=namespace, kind=kind, threshold=threshold), build)
