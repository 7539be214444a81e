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

import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from elm_memory.errors import IncompatibleMemoryError, MemoryKindError, StoreError
from elm_memory.memory import LatentMemory, MemoryMeta, TrainingStats
from elm_memory.retrieval.keys import LAYERWISE_KINDS
from elm_memory.store.names import question_hash

if TYPE_CHECKING:
    from elm_memory.store.chroma import ChromaMemoryStore

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
    store: ChromaMemoryStore, *, namespace: str | None = None, kind: str = "input", threshold: float = DEFAULT_THRESHOLD
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


# ---- the merged memory ------------------------------------------------------------------------


def combine_keys(kind: str, keys: Sequence[torch.Tensor]) -> torch.Tensor:
    """The merged memory's key of ``kind`` from its members' keys: their mean, renormalised as the key
    builder would. ``kv`` and ``kv_centered`` keys are concatenated unit vectors, one per layer (norm
    sqrt(L)): the mean is cut into the same L blocks and each is scaled back to unit norm. ``input`` and
    ``soft_prompt_mean`` keys are plain means (the builders do not normalise; ``soft_prompt_mean`` of an
    averaged prompt is exactly this mean)."""
    stacked = torch.stack([k.detach().to(torch.float32).reshape(-1) for k in keys])
    mean = stacked.mean(dim=0)
    if kind in LAYERWISE_KINDS:
        layers = round(float(stacked[0].norm()) ** 2)
        if layers >= 1 and mean.numel() % layers == 0:
            blocks = mean.view(layers, -1)
            return torch.nn.functional.normalize(blocks, dim=-1).reshape(-1)
    return mean


def common_kinds(members: Sequence[LatentMemory]) -> list[str]:
    kinds = set(members[0].keys)
    for m in members[1:]:
        kinds &= set(m.keys)
    return sorted(kinds)


def merged_stats(members: Sequence[LatentMemory], trained: Sequence[TrainingStats] = ()) -> TrainingStats:
    """Stats of a merged memory: ``trained`` (one run per member question, from a ``train`` merge)
    averaged per step, else an untrained record (``engine`` ``merge``, 0 steps). The majority answer
    is the members' (or the runs') common one, None when they differ; the share is their mean."""
    runs = list(trained) or [m.meta.stats for m in members]
    answers = {s.majority_answer for s in runs}
    stats = TrainingStats(
        engine=trained[0].engine if trained else "merge",
        objective=runs[0].objective,
        majority_answer=answers.pop() if len(answers) == 1 else None,
        majority_share=sum(s.majority_share for s in runs) / len(runs),
        no_consensus=all(s.no_consensus for s in runs),
    )
    if trained:
        n = min(len(s.mean_reward) for s in trained) if all(s.mean_reward for s in trained) else 0
        stats.steps = trained[0].steps
        stats.mean_reward = [sum(s.mean_reward[i] for s in trained) / len(trained) for i in range(n)]
        stats.loss = [sum(s.loss[i] for s in trained) / len(trained) for i in range(min(len(s.loss) for s in trained))]
        stats.kl = [sum(s.kl[i] for s in trained) / len(trained) for i in range(min(len(s.kl) for s in trained))]
        stats.skipped_backward = [
            all(s.skipped_backward[i] for s in trained) for i in range(min(len(s.skipped_backward) for s in trained))
        ]
        stats.answers = [sum((s.answers[i] for s in trained), []) for i in range(min(len(s.answers) for s in trained))]
        stats.seconds = max(s.seconds for s in trained)  # trained together: each run reports the batch's time
        stats.generation_seconds = max(s.generation_seconds for s in trained)
        stats.backward_seconds = max(s.backward_seconds for s in trained)
        stats.completion_tokens = sum(s.completion_tokens for s in trained)
    return stats


def build_merged(
    members: Sequence[LatentMemory],
    soft_prompt: torch.Tensor,
    strategy: str,
    *,
    keys: dict[str, torch.Tensor] | None = None,
    stats: TrainingStats | None = None,
    extra: dict[str, Any] | None = None,
) -> LatentMemory:
    """The merged memory of ``members`` (oldest first): a new id, the oldest member's question, the
    youngest member's creation time, keys combined from the members' unless given, provenance."""
    if len(members) < 2:
        raise StoreError("a merge needs at least two memories")
    first = members[0].meta
    for m in members[1:]:
        if (m.meta.model_fingerprint, m.meta.namespace, m.meta.hidden_size) != (
            first.model_fingerprint,
            first.namespace,
            first.hidden_size,
        ):
            raise IncompatibleMemoryError(
                f"memories {first.id[:8]} and {m.id[:8]} belong to different models or namespaces: never merged"
            )
    kinds = common_kinds(members)
    if keys is None:
        keys = {kind: combine_keys(kind, [m.keys[kind] for m in members]) for kind in kinds}
    config = {**first.config, "merge": {"strategy": strategy, "members": len(members), **(extra or {})}}
    meta = MemoryMeta(
        id=uuid.uuid4().hex,
        namespace=first.namespace,
        question=first.question,
        question_hash=question_hash(first.question),
        model_name=first.model_name,
        hidden_size=first.hidden_size,
        model_fingerprint=first.model_fingerprint,
        created_at=max(m.meta.created_at for m in members),
        num_tokens=int(soft_prompt.shape[0]),
        config=config,
        stats=stats if stats is not None else merged_stats(members),
        merged_from=[m.id for m in members],
        merge_strategy=strategy,
    )
    return LatentMemory(soft_prompt=soft_prompt, meta=meta, keys=keys)


def require_soft_prompts(members: Sequence[LatentMemory]) -> None:
    """Merging averages soft prompts; a lora or prefix memory is refused (:class:`MemoryKindError`)
    rather than averaged (a mean of LoRA factors is not the mean of their deltas)."""
    for m in members:
        if m.kind != "soft_prompt":
            raise MemoryKindError(f"memory {m.id[:8]} is a {m.kind} memory: only soft-prompt memories can be merged")


def average_memory(members: Sequence[LatentMemory]) -> LatentMemory:
    """``average``: the mean of the members' soft prompts (all of one length k)."""
    require_soft_prompts(members)
    shapes = {tuple(m.soft_prompt.shape) for m in members}
    if len(shapes) != 1:
        raise StoreError(f"cannot average soft prompts of different shapes: {sorted(shapes)}")
    soft = torch.stack([m.soft_prompt for m in members]).mean(dim=0)
    return build_merged(members, soft, "average")


# ---- running a merge --------------------------------------------------------------------------


def merge_clusters(
    store: ChromaMemoryStore, clusters: Sequence[Cluster], build: MergeBuilder = average_memory
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
    store: ChromaMemoryStore,
    *,
    namespace: str | None = None,
    kind: str = "input",
    threshold: float = DEFAULT_THRESHOLD,
    build: MergeBuilder = average_memory,
) -> list[MergeOutcome]:
    """Find the clusters and merge each (``elm memories merge`` without ``--dry-run``)."""
    return merge_clusters(store, find_clusters(store, namespace=namespace, kind=kind, threshold=threshold), build)
