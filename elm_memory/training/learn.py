"""Learn memories: initialise from the question, train with the configured engine, package.

The engine comes from the ``training_engines`` registry (:mod:`elm_memory.training.engines`);
every engine returns a soft prompt (or, for ``memory.kind`` lora/prefix, an adapter) and
:class:`~elm_memory.memory.TrainingStats`, so the memories packaged here have the same format
whichever trained them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elm_memory.backends.base import GenerationBackend
from elm_memory.backends.prompting import PromptBuilder, validate_question
from elm_memory.config import ELMConfig
from elm_memory.memory import LatentMemory
from elm_memory.memory.init import question_init
from elm_memory.memory.kinds import LORA, PREFIX, SOFT_PROMPT, MemoryAdapter
from elm_memory.memory.lora import LoraAdapter
from elm_memory.memory.prefix import question_prefix
from elm_memory.models.loading import LoadedModel
from elm_memory.training.engines import StepCallback, Trainer, build_trainer


def learn_memory(
    question: str,
    *,
    config: ELMConfig,
    loaded: LoadedModel,
    backend: GenerationBackend,
    prompts: PromptBuilder,
    namespace: str | None = None,
    trainer: Trainer | None = None,
    progress: bool | None = None,
    memory_id: str | None = None,
) -> LatentMemory:
    """Train a soft prompt on ``question`` (no ground truth) and return it as a LatentMemory.

    Nothing is written anywhere: storing is the caller's (store's) job, so an interrupted
    or failed training leaves no trace.
    """
    [memory] = learn_memories(
        [question],
        config=config,
        loaded=loaded,
        backend=backend,
        prompts=prompts,
        namespace=namespace,
        trainer=trainer,
        progress=progress,
        memory_ids=[memory_id],
    )
    return memory


def learn_memories(
    questions: Sequence[str],
    *,
    config: ELMConfig,
    loaded: LoadedModel,
    backend: GenerationBackend,
    prompts: PromptBuilder,
    namespace: str | Sequence[str | None] | None = None,
    trainer: Trainer | None = None,
    progress: bool | None = None,
    memory_ids: Sequence[str | None] | None = None,
    on_step: StepCallback | None = None,
) -> list[LatentMemory]:
    """One memory per question, trained together (:meth:`NativeTrainer.train_many`: each
    equals the memory trained alone); ``namespace`` is one for all or one per question.
    Nothing is written anywhere, and one failure (e.g. a NaN) fails the whole call."""
    questions = [validate_question(q) for q in questions]
    namespaces = [namespace] * len(questions) if namespace is None or isinstance(namespace, str) else list(namespace)
    ids = list(memory_ids) if memory_ids is not None else [None] * len(questions)
    if len(namespaces) != len(questions) or len(ids) != len(questions):
        raise ValueError("learn_memories needs one namespace and one memory id per question")
    k = config.memory.num_tokens
    items = []
    for question in questions:
        prompt = prompts.answer_prompt(question, memory_tokens=k)  # training sees the prompt answering sees
        items.append((prompt.token_ids, initial_memory(config, loaded, question), prompt.memory_at))
    trainer = trainer or build_trainer(config, loaded, backend)
    if on_step is None:  # a plugin engine written before on_step existed keeps working
        results = trainer.train_many(items, progress=progress)
    else:
        results = trainer.train_many(items, progress=progress, on_step=on_step)
    recipe = {
        "training": config.training.model_dump(mode="json"),
        "memory": memory_recipe(config),
        "soft_prompt_position": config.prompt.soft_prompt_position,
        "prompt_template": config.prompt.template,
    }
    return [
        LatentMemory.create(
            result.soft_prompt,
            question=question,
            namespace=ns or config.namespace,
            model=loaded.info,
            config=recipe,
            stats=result.stats,
            memory_id=mid,
            adapter=result.adapter,
        )
        for question, ns, mid, result in zip(questions, namespaces, ids, results, strict=True)
    ]


def initial_memory(config: ELMConfig, loaded: LoadedModel, question: str) -> torch.Tensor | MemoryAdapter:
    """What training of ``question``'s memory starts from, by ``memory.kind``: the question-initialised
    soft prompt, a zero-B LoRA (the base model), or the question's own last-k keys/values as a prefix."""
    m = config.memory
    if m.kind == LORA:
        return LoraAdapter.initial(loaded.model, rank=m.lora_rank, alpha=m.lora_alpha, seed=config.training.seed)
    if m.kind == PREFIX:
        return question_prefix(loaded, loaded.tokenizer(question, add_special_tokens=False)["input_ids"], m.num_tokens)
    return question_init(loaded, question, m.num_tokens, m.init, config.training.seed)


def memory_recipe(config: ELMConfig) -> dict[str, Any]:
    """``memory`` settings recorded in a memory's file. A soft prompt records what it always did (num_tokens,
    init), so its file is unchanged by the kind settings it does not use."""
    if config.memory.kind == SOFT_PROMPT:
        return config.memory.model_dump(mode="json", include={"num_tokens", "init"})
    return config.memory.model_dump(mode="json")
