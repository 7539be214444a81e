"""The per-memory state of :class:`~elm_memory.training.native.NativeTrainer`: what one memory holds while
it trains (its parameters, optimiser and stats) and one step's completions and rewards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elm_memory.config import TrainingConfig
from elm_memory.memory import TrainingStats
from elm_memory.memory.kinds import MemoryAdapter
from elm_memory.training.rewards import GroupReward


@dataclass
class TrainResult:
    soft_prompt: torch.Tensor | None  # (k, hidden) float32, CPU; None for a lora/prefix memory
    stats: TrainingStats
    adapter: MemoryAdapter | None = None  # the trained lora/prefix memory (detached, CPU)


@dataclass
class StepBatch:
    """One step's completions per memory (G rollouts, or the one SFT target) and their rewards
    (None under SFT)."""

    step: int
    objective: str
    completions: list[list[list[int]]]
    groups: list[GroupReward | None]


@dataclass
class MemoryRun:
    """One memory's training state inside :meth:`NativeTrainer.train_many`, and its stats bookkeeping.

    A soft prompt (``init``, ``soft``) or a lora/prefix ``adapter`` whose tensors are the parameters
    (``reference``: its initial copy, the KL reference)."""

    prompt_ids: list[int]
    at: int
    init: torch.Tensor
    soft: torch.nn.Parameter
    optim: torch.optim.Optimizer
    stats: TrainingStats
    sft_target: list[int] | None = None
    saw_answer: bool = False
    adapter: MemoryAdapter | None = None
    reference: MemoryAdapter | None = None

    @classmethod
    def start(
        cls,
        prompt_ids: Sequence[int],
        init: torch.Tensor | MemoryAdapter,
        at: int,
        cfg: TrainingConfig,
        lr: float,
        engine: str,
        objective: str,
    ) -> MemoryRun:
        stats = TrainingStats(engine=engine, objective=objective)
        if not isinstance(init, torch.Tensor):
            adapter = init.trainable()  # type: ignore[attr-defined]  # both adapter classes have it
            optim = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=cfg.weight_decay)
            empty = torch.nn.Parameter(torch.empty(0))  # no soft prompt: the adapter is the memory
            return cls(
                list(prompt_ids), at, empty.detach(), empty, optim, stats, adapter=adapter, reference=init.detached()
            )
        init = init.detach().to(torch.float32)
        soft = torch.nn.Parameter(init.clone())
        # One AdamW per memory: its step count and moments move only when this memory updates.
        optim = torch.optim.AdamW([soft], lr=lr, weight_decay=cfg.weight_decay)
        return cls(list(prompt_ids), at, init, soft, optim, stats)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.adapter.parameters() if self.adapter is not None else [self.soft]

    @property
    def what(self) -> str:
        return "soft prompt" if self.adapter is None else f"{self.adapter.kind} memory"

    def snapshot(self) -> torch.Tensor | MemoryAdapter:
        """The memory as it is now, unaffected by later optimizer steps (what rollouts sample under)."""
        return self.adapter.detached() if self.adapter is not None else self.soft.detach().clone()

    def record_group(self, group: GroupReward, completions: list[list[int]]) -> None:
        """A step's rollouts: their answers, mean reward, majority and length."""
        s = self.stats
        self.saw_answer = self.saw_answer or any(a is not None for a in group.answers)
        s.answers.append(group.answers)
        s.mean_reward.append(sum(group.rewards) / len(group.rewards))
        s.majority_answer, s.majority_share = group.vote.answer, group.vote.share
        s.completion_tokens += sum(len(c) for c in completions)

    def record_skip(self) -> None:
        """A step without backward (uniform rewards): zero loss, the KL unchanged."""
        s = self.stats
        s.skipped_backward.append(True)
        s.loss.append(0.0)
        s.kl.append(s.kl[-1] if s.kl else 0.0)
        s.steps += 1

    def record_update(self, loss: float, kl: float, seconds: float) -> None:
        s = self.stats
        s.backward_seconds += seconds
        s.skipped_backward.append(False)
        s.loss.append(loss)
        s.kl.append(kl)
        s.steps += 1

    def result(self, seconds: float, *, trained: bool) -> TrainResult:
        self.stats.no_consensus = not self.saw_answer if trained else False
        self.stats.seconds = seconds
        if self.adapter is not None:
            return TrainResult(soft_prompt=None, stats=self.stats, adapter=self.adapter.detached())
        return TrainResult(soft_prompt=self.soft.detach().to("cpu", torch.float32).clone(), stats=self.stats)
