"""The answer path's generations a stream memory learns from: the sampling verifier's seeded rows at the answer's
budget, put under the serving memory, and what each drew (shared by the evaluation and the graph)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elm_memory.answers.vote import plurality_vote
from elm_memory.backends.base import GenerateRequest, PromptInput, SamplingParams
from elm_memory.training.losses import advantages_from_rewards


def answer_budget_samples(sampler: Any, question: str, prompt: Any, answer: SamplingParams) -> GenerateRequest:
    """The sampling verifier's seeded rows for ``question`` (from ``prompt``'s zero-shot form), their budget cut
    to the answer's: the samples a stream memory votes over and learns from are answers like its greedy one."""
    rows, params = sampler.sample_request(question, prompt.zero_shot())
    return rows, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, answer.max_new_tokens))


def under_soft_prompt(rows: Sequence[Any], soft: torch.Tensor, at: int) -> list[PromptInput]:
    """The same rows (seeds kept) with the stream memory's soft prompt inserted at ``at``: on-policy samples."""
    return [dataclasses.replace(p, soft_prompt=soft, soft_prompt_at=at) for p in rows]


@dataclass(frozen=True)
class Generated:
    """One generation the answer path drew with the stream memory: its tokens and final answer."""

    token_ids: Sequence[int]
    answer: str | None
    sampled: bool  # a sample (on-policy for GRPO), not the greedy answer


def own_vote(served: Sequence[str | None]) -> str | None:
    """The memory's vote over its own answers (greedy first): with ``learn_from: own`` the label itself; with
    ``zero_shot`` not the label (self-consistency's, which no rollback can change): what the guard counts."""
    return plurality_vote(served[1:], served[0], with_greedy=True) if served else None


def learnable_rows(rewards: Sequence[float], sampled: Sequence[bool], objective: str) -> tuple[list[int], torch.Tensor]:
    """Which generations an update learns from, and their weights. ``grpo``: the samples, weighted by the Dr.GRPO
    advantage r - mean(r) (none when every sample gets the same reward: no gradient). ``sft``: the generations
    that agree with the label, weight 1 (none when none does)."""
    if objective == "grpo":
        rows = [i for i, s in enumerate(sampled) if s]
        r = torch.tensor([rewards[i] for i in rows], dtype=torch.float32)
        if len(rows) < 2 or bool((r == r[0]).all()):
            return [], torch.zeros(0)
        return rows, advantages_from_rewards(r, scale=False)
    rows = [i for i, r in enumerate(rewards) if r > 0]
    return rows, torch.ones(len(rows))
