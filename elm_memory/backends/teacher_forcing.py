"""Teacher forcing: one forward of the frozen model over prompt (+ soft prompt) + a known
completion, giving what the model predicted at each completion token.

The one routine behind every "how likely is this completion" question in the library: the
``hf`` backend's per-token log-probs, the policy-model verifiers' scores and the trainer's
policy/reference log-probs. Keeping it in one place keeps the three numerically the same.

Several completions go through one forward. Each carries its own prompt (``rows``), so the
trainer can put several memories in one batch: prompts are left-padded and completions
right-padded, so every completion starts at the same column and one ``logits_to_keep``
serves all rows. With ``share_prompt_kv`` each distinct prompt is run once and its KV
cache repeated for its rows instead.

Gradients flow into any soft prompt that requires grad, and into a ``lora``/``prefix`` memory's
tensors (``PromptInput.memory``, applied around the forwards; all prompts of one call share it);
callers that only read wrap the call in ``torch.no_grad()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, cast

import torch

from elm_memory.backends.base import PromptInput, compose_embeddings
from elm_memory.backends.sampling import tempered
from elm_memory.memory.kinds import AppliedMemory, shared_memory
from elm_memory.models.logits import last_positions


def completion_logits(
    model: Any,
    prompts: Sequence[PromptInput],
    completions: Sequence[Sequence[int]],
    *,
    rows: Sequence[int] | None = None,
    share_prompt_kv: bool = False,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, vocab) logits predicting each completion token, the (B, T) completion ids and mask.

    Completion ``i`` is read under ``prompts[rows[i]]`` (every completion under ``prompts[0]``
    without ``rows``). Completions are right-padded with ``pad_id`` to the longest, T >= 1.
    """
    pieces, comp, mask = _completion_logit_pieces(
        model, prompts, completions, rows=rows, share_prompt_kv=share_prompt_kv, pad_id=pad_id
    )
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), comp, mask


def _completion_logit_pieces(
    model: Any,
    prompts: Sequence[PromptInput],
    completions: Sequence[Sequence[int]],
    *,
    rows: Sequence[int] | None,
    share_prompt_kv: bool,
    pad_id: int,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """:func:`completion_logits` with the logits as consecutive pieces along T (the shared-prompt path
    gets the first position from the prompt's forward and the rest from the completion's): joining
    them copies every logit, and the log-probs need no join."""
    if rows is None:
        rows = [0] * len(completions)
    embed = model.get_input_embeddings()
    device = embed.weight.device
    composed: dict[int, torch.Tensor] = {
        # each prompt embedded once, however many rows it has
        p: compose_embeddings(prompts[p], lambda ids: embed(ids.to(device)))
        for p in dict.fromkeys(rows)
    }
    B = len(completions)
    T = max(1, max(len(c) for c in completions))
    comp = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(B, T, dtype=torch.long, device=device)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = 1
    memory = shared_memory([prompts[p].memory for p in composed])
    forward_rows = len(composed) if share_prompt_kv else B  # the batch of the first forward
    with memory.apply(model, forward_rows) if memory is not None else nullcontext(AppliedMemory()) as applied:
        if share_prompt_kv:
            pieces = _logits_shared_prompt(model, composed, rows, comp, mask, applied)
        else:
            pieces = [_logits_full_rows(model, composed, rows, comp, mask, applied)]
    return pieces, comp, mask


def completion_logprobs(
    model: Any,
    prompts: Sequence[PromptInput],
    completions: Sequence[Sequence[int]],
    *,
    rows: Sequence[int] | None = None,
    temperature: float = 1.0,
    share_prompt_kv: bool = False,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) float32 log-probs of each completion token under ``logits / temperature``, and the mask.

    ``temperature``: the distribution the completions were sampled from (as TRL scores
    rollouts); 1 for the model's own distribution. Arguments as :func:`completion_logits`.
    """
    pieces, comp, mask = _completion_logit_pieces(
        model, prompts, completions, rows=rows, share_prompt_kv=share_prompt_kv, pad_id=pad_id
    )
    return cast(torch.Tensor, _TokenLogprobs.apply(temperature, comp, *pieces)), mask


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature) at the target tokens, (B, T) float32, from logits given as
    pieces along T; the gradient is what autograd gives the plain expression
    ``(row.float() / t).gather(targets) - logsumexp(row.float() / t)``, bit for bit (tested).

    Written out because the plain expression keeps a float32 copy of every row's (T, vocab) logits
    for its backward and runs about ten passes over them there; this keeps only the logits and the
    log-normalisers, and its backward makes each row's gradient in place in one float32 buffer
    (measured in docs/performance.md)."""

    @staticmethod
    def forward(ctx: Any, temperature: float, targets: torch.Tensor, *pieces: torch.Tensor) -> torch.Tensor:
        rows = targets.shape[0]
        out = torch.empty(targets.shape, dtype=torch.float32, device=targets.device)
        norms = torch.empty_like(out)
        col = 0
        for piece in pieces:  # one row at a time keeps the float32 copy of (T, vocab) small
            n = piece.shape[1]
            for i in range(rows if n else 0):
                row = tempered(piece[i], temperature)
                norm = torch.logsumexp(row, dim=-1)
                out[i, col : col + n] = row.gather(1, targets[i, col : col + n].unsqueeze(1)).squeeze(1) - norm
                norms[i, col : col + n] = norm
            col += n
        ctx.temperature = temperature
        ctx.save_for_backward(targets, norms, *pieces)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        targets, norms, *pieces = ctx.saved_tensors
        temperature = ctx.temperature
        grads: list[torch.Tensor | None] = []
        col = 0
        for k, piece in enumerate(pieces):
            n = piece.shape[1]
            if not ctx.needs_input_grad[2 + k]:
                grads.append(None)
                col += n
                continue
            piece_grad = torch.empty_like(piece)
            for i in range(piece.shape[0] if n else 0):
                g = grad[i, col : col + n].unsqueeze(1)
                # autograd's order: the softmax term (-g) * exp(x/t - lse), the target's g added, then / t
                d = tempered(piece[i], temperature)  # the forward's row again, then in place
                d.sub_(norms[i, col : col + n].unsqueeze(1)).exp_().mul_(-g)
                d.scatter_add_(1, targets[i, col : col + n].unsqueeze(1), g)
                piece_grad[i].copy_(d.div_(temperature))
            grads.append(piece_grad)
            col += n
        return (None, None, *grads)


def _logits_full_rows(
    model: Any,
    composed: dict[int, torch.Tensor],
    rows: Sequence[int],
    comp: torch.Tensor,
    mask: torch.Tensor,
    applied: AppliedMemory,
) -> torch.Tensor:
    """(B, T, vocab) logits for the completion tokens, each row carrying its own copy of its prompt."""
    T = comp.shape[1]
    width = max(e.shape[0] for e in composed.values())
    # Prompts are left-padded to a common width, completions right-padded: every completion
    # starts at the same column. Position ids count real tokens only, so each row sees exactly
    # the positions it has alone (right pads are harmless for a causal model: real tokens never
    # attend to the pads after them).
    prompt_emb, prompt_mask = _left_padded(composed, rows, width)
    full = torch.cat([prompt_emb, model.get_input_embeddings()(comp)], dim=1)
    attn = torch.cat([prompt_mask, mask], dim=1)
    kwargs: dict[str, Any] = {"use_cache": False}
    if applied.cache is not None:  # a prefix memory: its keys/values come first in every layer
        kwargs = {"use_cache": True, "past_key_values": applied.cache}
    length = full.shape[1]
    if _keeps_logits(model):
        # exactly the T positions that predict completion tokens (position t predicts token t + 1): a
        # slice of the logits afterwards would cost a zero-filled copy of them all in the backward
        kwargs["logits_to_keep"] = torch.arange(length - T - 1, length - 1, device=full.device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(inputs_embeds=full, attention_mask=applied.mask(attn), position_ids=positions, **kwargs).logits
    return logits if logits.shape[1] == T else logits[:, -(T + 1) : -1, :]


def _logits_shared_prompt(
    model: Any,
    composed: dict[int, torch.Tensor],
    rows: Sequence[int],
    comp: torch.Tensor,
    mask: torch.Tensor,
    applied: AppliedMemory,
) -> list[torch.Tensor]:
    """As :func:`_logits_full_rows`, but each prompt goes through the model once and its KV cache is
    repeated for its rows: G rollouts of a memory cost one prompt forward/backward instead of G.
    Gradients reach the soft prompt through the cached keys/values. Two pieces along T: the first
    position (from the prompt's forward) and the rest."""
    from transformers import DynamicCache

    T = comp.shape[1]
    device = comp.device
    order = list(composed)  # the distinct prompts, each once
    width = max(e.shape[0] for e in composed.values())
    lengths = torch.tensor([composed[p].shape[0] for p in order], device=device)
    prompt_emb, prompt_mask = _left_padded(composed, order, width)
    cache = applied.cache if applied.cache is not None else DynamicCache()
    out = model(
        inputs_embeds=prompt_emb,
        attention_mask=applied.mask(prompt_mask),
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last_positions(1, width, device),
    )
    index = {p: u for u, p in enumerate(order)}
    which = torch.tensor([index[p] for p in rows], device=device)
    cache.batch_select_indices(which)  # row i now holds its prompt's keys/values (differentiable)
    first = out.logits[:, -1, :][which]  # predicts each completion's first token
    attn = applied.mask(torch.cat([prompt_mask[which], mask], dim=1))
    positions = lengths[which].unsqueeze(1) + torch.arange(T, device=device).unsqueeze(0)
    # the completion's last token predicts nothing we score: keep positions 0..T-2 only (a slice of
    # the logits afterwards would cost a zero-filled copy of them all in the backward)
    keep = torch.arange(T - 1, device=device) if T > 1 else last_positions(1, T, device)
    rest = model(
        inputs_embeds=model.get_input_embeddings()(comp),
        attention_mask=attn,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=keep,
    ).logits
    if rest.shape[1] != T - 1:  # even a slice of every position has a zero-filling backward
        rest = rest[:, : T - 1, :]
    return [first.unsqueeze(1), rest]


def _left_padded(
    composed: dict[int, torch.Tensor], keys: Sequence[int], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(len(keys), width, hidden) prompt embeddings ``composed[k]``, left-padded with zeros, and their mask."""
    hidden = next(iter(composed.values())).shape[1]
    emb = torch.stack(
        [torch.cat([composed[k].new_zeros(width - composed[k].shape[0], hidden), composed[k]]) for k in keys]
    )
    lengths = torch.tensor([composed[k].shape[0] for k in keys], device=emb.device)
    mask = (torch.arange(width, device=emb.device).unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
    return emb, mask


def _keeps_logits(model: Any) -> bool:
    # transformers' causal LMs take logits_to_keep (only the completion positions reach the
    # lm_head); a model without it returns every position, which the caller slices.
    return "logits_to_keep" in inspect.signature(model.forward).parameters
