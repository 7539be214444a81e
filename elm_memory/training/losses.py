"""Policy-gradient losses on per-token log-probabilities (one policy update per batch).

With one update per generated batch the importance ratio pi/pi_old is 1 in value, but it
must stay in the graph: ``exp(logp - logp.detach())`` has gradient ``grad logp``. The KL
to the reference is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0).
"""

from __future__ import annotations

import torch


def advantages_from_rewards(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """Group-relative advantage r - mean(r); divided by std only when ``scale`` (not in Dr.GRPO)."""
    adv = rewards - rewards.mean()
    if scale:
        adv = adv / (rewards.std() + 1e-4)
    return adv


def policy_loss(
    logps: torch.Tensor,  # (B, T) current policy log-probs of the completion tokens
    ref_logps: torch.Tensor | None,  # (B, T) reference log-probs, or None when beta == 0
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 for completion tokens, 0 for padding
    *,
    beta: float,
    loss_type: str,
    max_completion_length: int,
    group_size: int | None = None,  # rows in the whole group, when called on a micro-batch
    group_tokens: int | None = None,  # completion tokens in the whole group (bnpo on a micro-batch)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss, mean per-token KL). ``dr_grpo``: token sum / (G * max_completion_length).

    Every normaliser is group-wide, so summing the losses of micro-batches gives the loss of the group.
    """
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - logps.detach())
    per_token = -ratio * advantages.unsqueeze(1)
    kl = torch.zeros((), dtype=logps.dtype)
    if ref_logps is not None and beta != 0.0:
        delta = ref_logps - logps
        per_token_kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * per_token_kl
        kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)
    rows = group_size or logps.shape[0]
    if loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (rows * max_completion_length)
    elif loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rows
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / max(1.0, float(group_tokens) if group_tokens else mask.sum().item())
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return loss, kl.detach()


def sft_loss(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the target tokens (the ELM-SFT ablation)."""
    mask = mask.to(logps.dtype)
    return -(logps * mask).sum() / mask.sum().clamp(min=1.0)
