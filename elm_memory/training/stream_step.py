"""A stream memory's tensors and one update's arithmetic: the untrained memory, what an update did
(:class:`StreamUpdate`), the objective's backward over a question's rows, and the optimizer's moments by name (so
a version's file holds them and another process continues the same run)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.errors import NonFiniteError
from elm_memory.memory.init import init_soft_prompt
from elm_memory.memory.kinds import SOFT_PROMPT
from elm_memory.memory.lora import LoraAdapter
from elm_memory.training.losses import policy_loss, sft_loss


@dataclass
class StreamUpdate:
    """What one question did to the stream memory (recorded with the answer)."""

    version_used: int  # the version that drew the generations
    version: int  # the version that serves after this question
    label: str | None
    rewards: list[float] = field(default_factory=list)
    applied: bool = False
    # why no update: "uniform_rewards" | "no_agreeing" | "weak_label" | "rolled_back" | "stream_deleted" | ...
    skipped: str | None = None
    loss: float | None = None
    grad_norm: float | None = None
    moved: float | None = None  # ||memory - init|| / ||init|| after the update (all its tensors)
    seconds: float = 0.0
    guard: dict[str, Any] | None = None  # the window's verdict, when this question closed one
    gate: dict[str, Any] | None = None  # the gate's reading of this question and its state after it (amortized)
    gate_decision: dict[str, Any] | None = None  # a change of the gate's state, with why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def initial_stream_tensors(config: Any, loaded: Any, kind: str) -> dict[str, torch.Tensor]:
    """The untrained stream memory's tensors by name: a soft prompt (``stream.tuning.init``: the format instruction's
    token embeddings tiled to k, or random), or a LoRA with B = 0 (the base model exactly)."""
    if kind == SOFT_PROMPT:
        ids = loaded.tokenizer(config.stream.tuning.format_instruction, add_special_tokens=False)["input_ids"]
        mode = "question" if config.stream.tuning.init == "instruction" else "random"
        embeddings = loaded.model.get_input_embeddings()
        return {"soft_prompt": init_soft_prompt(embeddings, ids, config.memory.num_tokens, mode, config.training.seed)}
    m = config.memory
    return LoraAdapter.initial(loaded.model, rank=m.lora_rank, alpha=m.lora_alpha, seed=config.training.seed).tensors()


def backward_rows(
    loaded: Any,
    prompt: PromptInput,
    completions: list[list[int]],
    weights: torch.Tensor,
    *,
    objective: str,
    temperature: float,
    scale: float = 1.0,
) -> float:
    """Backward of ``objective`` over ``completions`` of ``prompt`` (one row at a time: a CPU keeps the peak of one);
    ``grpo``: Dr.GRPO with ``weights`` as advantages; ``sft``: the mean log-likelihood. The summed loss."""
    pad = loaded.tokenizer.pad_token_id or 0
    total = 0.0
    n = len(completions)
    max_len = max(1, max(len(c) for c in completions))
    for comp, weight in zip(completions, weights, strict=True):
        logps, mask = completion_logprobs(loaded.model, [prompt], [comp], temperature=temperature, pad_id=pad)
        if objective == "grpo":
            loss, _ = policy_loss(
                logps,
                None,
                weight.reshape(1),
                mask,
                beta=0.0,
                loss_type="dr_grpo",
                max_completion_length=max_len,
                group_size=n,
            )
        else:
            loss = sft_loss(logps, mask) / n
        if not torch.isfinite(loss):
            raise NonFiniteError(f"stream memory loss is {loss.item()}")
        loss = loss * scale
        loss.backward()
        total += float(loss.item())
    return total


def optimizer_moments(
    optim: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], *, prefixed: bool
) -> dict[str, torch.Tensor]:
    """The moments by name: ``<tensor>/<moment>`` (``prefixed``, a LoRA's), else the moment's name alone (a soft
    prompt's one tensor, as its files have always held them)."""
    out = {}
    for name, p in params.items():
        for key, value in optim.state.get(p, {}).items():
            out[f"{name}/{key}" if prefixed else key] = value.detach().clone()
    return out


def set_optimizer_moments(
    optim: torch.optim.Optimizer,
    params: dict[str, torch.nn.Parameter],
    state: dict[str, torch.Tensor],
    *,
    prefixed: bool,
) -> None:
    """Load :func:`optimizer_moments`' output back into ``optim``."""
    for name, p in params.items():
        mine = {k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == name} if prefixed else state
        if mine:
            optim.state[p] = {k: v.clone() for k, v in mine.items()}


def relative_distance(params: Mapping[str, torch.Tensor], init: Mapping[str, torch.Tensor]) -> float:
    """||memory - init|| / ||init|| over all the memory's tensors."""
    diff = sum(float((p.detach() - init[n]).pow(2).sum()) for n, p in params.items())
    base = sum(float(t.pow(2).sum()) for t in init.values())
    return (diff**0.5) / max(base**0.5, 1e-12)


def _parameters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    """Trainable float32 copies of a memory's tensors, by name."""
    return {n: torch.nn.Parameter(t.detach().to(torch.float32).clone()) for n, t in tensors.items()}
