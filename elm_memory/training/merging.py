"""The ``train`` merge strategy: a merged memory trained briefly on its members' questions.

Memories do not store their initial soft prompt, but it is a function of the question and the
recipe the memory records (``config.memory.init``, ``config.training.seed``; see
:mod:`elm_memory.memory.init`), so each member's initial prompt is rebuilt
exactly. The merged prompt starts from their mean; then each member's question trains a copy
of it for ``steps`` GRPO steps (TTRL reward, no ground truth), all together in one
:meth:`~elm_memory.training.native.NativeTrainer.train_many` call (the existing entry point,
so the configured engine, G and rollout settings apply), and the merged soft prompt is the
mean of the trained copies: one round of federated averaging. Keys: the members' ``input``
keys averaged (:func:`~elm_memory.store.merge.combine_keys`), the others rebuilt from the
merged soft prompt with the registered key builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elm_memory.backends.base import GenerationBackend
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.memory import LatentMemory
from elm_memory.memory.init import question_init
from elm_memory.models.loading import LoadedModel
from elm_memory.store.merge import build_merged, combine_keys, common_kinds, merged_stats, require_soft_prompts
from elm_memory.training.engines import Trainer, build_trainer


def initial_prompt(member: LatentMemory, loaded: LoadedModel, config: ELMConfig) -> torch.Tensor:
    """The soft prompt ``member`` was initialised with, rebuilt from its question and recorded recipe
    (the config's where the memory records none)."""
    recipe: dict[str, Any] = member.meta.config
    memory_cfg = recipe.get("memory") if isinstance(recipe.get("memory"), dict) else {}
    training_cfg = recipe.get("training") if isinstance(recipe.get("training"), dict) else {}
    mode = str((memory_cfg or {}).get("init", config.memory.init))
    seed = (training_cfg or {}).get("seed", config.training.seed)
    seed = seed if isinstance(seed, int) else None
    return question_init(loaded, member.meta.question, member.meta.num_tokens, mode, seed)


def train_merged(
    members: Sequence[LatentMemory],
    *,
    config: ELMConfig,
    loaded: LoadedModel,
    backend: GenerationBackend,
    prompts: PromptBuilder,
    steps: int,
    trainer: Trainer | None = None,
    progress: bool | None = None,
) -> LatentMemory:
    """The merged memory of ``members`` (oldest first) by the ``train`` strategy (module docstring)."""
    from elm_memory.memory.keys import key_builders, tokenize_question

    require_soft_prompts(members)
    for m in members:
        m.check_compatible(loaded.info)
    init = torch.stack([initial_prompt(m, loaded, config) for m in members]).mean(dim=0)
    k = int(init.shape[0])
    items = []
    for m in members:
        prompt = prompts.answer_prompt(m.meta.question, memory_tokens=k)
        items.append((prompt.token_ids, init, prompt.memory_at))
    if trainer is None:
        cfg = config.model_copy(update={"training": config.training.model_copy(update={"steps": steps})})
        trainer = build_trainer(cfg, loaded, backend)
    results = trainer.train_many(items, progress=progress)
    soft = torch.stack([r.soft_prompt for r in results if r.soft_prompt is not None]).mean(dim=0)
    keys: dict[str, torch.Tensor] = {}
    known = set(key_builders.names())
    question_ids = tokenize_question(loaded.tokenizer, members[0].meta.question)
    for kind in common_kinds(members):
        if kind == "input" or kind not in known:
            keys[kind] = combine_keys(kind, [m.keys[kind] for m in members])
        else:
            key = key_builders.get(kind)().memory_keys(loaded, [soft], [question_ids])[0]
            keys[kind] = key.detach().to("cpu", torch.float32).contiguous()
    stats = merged_stats(members, [r.stats for r in results])
    return build_merged(members, soft, "train", keys=keys, stats=stats, extra={"steps": steps})
