"""Initial soft prompt: the question's own token embeddings (paper: "initialized from the
embeddings of the input question").

Rule (the same as PEFT's TEXT init): take the question's token ids (no special tokens,
no template); if there are more than k, keep the first k; if fewer, tile them from the
start until there are k. ``random`` draws from N(0, std of the embedding table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elm_memory.models.loading import LoadedModel


def tile_to_length(ids: Sequence[int], k: int) -> list[int]:
    if not ids:
        raise ValueError("cannot initialise a memory from an empty question")
    reps = math.ceil(k / len(ids))
    return (list(ids) * reps)[:k]


def init_soft_prompt(
    embedding: torch.nn.Embedding,
    question_ids: Sequence[int],
    k: int,
    mode: str = "question",
    seed: int | None = None,
) -> torch.Tensor:
    """(k, hidden) float32 tensor on CPU, detached."""
    weight = embedding.weight
    if mode == "question":
        ids = torch.tensor(tile_to_length(question_ids, k), dtype=torch.long, device=weight.device)
        out = weight[ids]
    elif mode == "random":
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        std = weight.detach().float().std().item()
        out = torch.randn(k, weight.shape[1], generator=gen) * std
    else:
        raise ValueError(f"unknown memory init {mode!r}")
    return out.detach().to("cpu", torch.float32).clone()


def question_init(loaded: LoadedModel, question: str, k: int, mode: str, seed: int | None) -> torch.Tensor:
    """The initial soft prompt of a memory of ``question``: what training starts from, and what a
    ``train`` merge rebuilds from a memory's recorded recipe (one function, so the two agree)."""
    ids = loaded.tokenizer(question, add_special_tokens=False)["input_ids"]
    return init_soft_prompt(loaded.model.get_input_embeddings(), ids, k, mode, seed)
