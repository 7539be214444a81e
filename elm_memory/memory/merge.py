"""The merge math: one memory from several (their keys, stats, provenance and averaged soft prompt).

Pure functions of memories, no store: :mod:`elm_memory.store.merge` clusters a store's memories and
commits what these build; :mod:`elm_memory.training.merging` trains a merged soft prompt and builds
the memory here.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

from elm_memory.errors import IncompatibleMemoryError, MemoryKindError, StoreError
from elm_memory.memory.ids import question_hash
from elm_memory.memory.keys import LAYERWISE_KINDS
from elm_memory.memory.latent import LatentMemory, MemoryMeta, TrainingStats


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
