"""A sampling loop for the transformers backend, shaped for GRPO rollouts on a CPU.

``model.generate`` with ``num_return_sequences=n`` copies each prompt n times *before*
the prefill and keeps finished rows in the batch until the longest one ends. For G=8
rollouts of a 150-token prompt that is 8x the prefill work, and with ``stop_at_answer``
most rows are padding long before the batch ends. This loop:

- **prefills each prompt once** and repeats its KV cache n times (``share_prompt_kv``);
- **drops finished rows** from the batch and the cache (``drop_finished``), so a step
  costs what the live rows cost;
- **samples each prompt from its own generator**, so a prompt's rollouts depend on its
  seed only, not on which other prompts share the batch (what training several memories
  together needs to equal training each alone).

Prompts of one batch may also carry **their own options** (a greedy answer decoded next to
n sampled rollouts, each row stopping at its own length): what lets answering and learning
share decode steps (:mod:`elm_memory.backends.fusing`). On a CPU a decode step is mostly fixed
cost (one batch-1 step of the 0.5B model reached a quarter of the memory-bandwidth bound, and
8 rows cost 1.2x one row), so rows that would have decoded one after another nearly come free.

Each lever is a :class:`~elm_memory.config.BackendConfig` switch; ``benchmarks/learn_throughput.py``
measures them against ``model.generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elm_memory.memories.base import AppliedMemory
from elm_memory.models.logits import last_positions

if TYPE_CHECKING:
    from elm_memory.memories.base import MemoryAdapter


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    n: int = 1
    share_prompt_kv: bool = True
    drop_finished: bool = True


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    attention_mask: torch.Tensor,
    options: DecodeOptions | Sequence[DecodeOptions],
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    eos_ids: Sequence[int] = (),
    generators: Sequence[torch.Generator | None] | None = None,
    should_stop: Callable[[int, list[int], int], bool] | None = None,
    memory: MemoryAdapter | None = None,
) -> list[tuple[list[int], str]]:
    """Generate ``options.n`` continuations of each left-padded prompt in the batch.

    Returns ``B * n`` rows (prompt-major: the n samples of prompt 0 first), each as
    ``(new token ids, finish reason)``; the reason is ``"stop"`` (an EOS token, included in
    the ids), ``"answer"`` (``should_stop(row, tokens, token)`` said so after ``token``) or
    ``"length"``. ``generators[i]`` draws prompt i's samples (None: the global RNG).
    ``memory``: a lora/prefix memory applied to every row (a prefix starts the KV cache).

    ``options`` may be one per prompt: prompt i then gets ``options[i].n`` rows, decoded at its
    own temperature, top-p and length (``share_prompt_kv``/``drop_finished`` are the first's).
    A prompt's rows and random draws are the ones it gets in a batch of its own.
    """
    inputs = input_ids if input_ids is not None else inputs_embeds
    assert inputs is not None, "pass input_ids or inputs_embeds"
    per_prompt = [options] * inputs.shape[0] if isinstance(options, DecodeOptions) else list(options)
    if len(per_prompt) != inputs.shape[0]:
        raise ValueError(f"{len(per_prompt)} decode options for {inputs.shape[0]} prompts")
    rows = sum(o.n for o in per_prompt)
    prefill_rows = rows if not per_prompt[0].share_prompt_kv else inputs.shape[0]
    with memory.apply(model, prefill_rows) if memory is not None else nullcontext(AppliedMemory()) as applied:
        return _sample(
            model, attention_mask, per_prompt, applied, input_ids, inputs_embeds, eos_ids, generators, should_stop
        )


def _sample(
    model: torch.nn.Module,
    attention_mask: torch.Tensor,
    per_prompt: list[DecodeOptions],
    applied: AppliedMemory,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    eos_ids: Sequence[int],
    generators: Sequence[torch.Generator | None] | None,
    should_stop: Callable[[int, list[int], int], bool] | None,
) -> list[tuple[list[int], str]]:
    """:func:`sample` under an applied memory (whose cache, if any, already holds a prefix)."""
    inputs = input_ids if input_ids is not None else inputs_embeds
    assert inputs is not None
    options = per_prompt[0]
    device = inputs.device
    mask = attention_mask.to(device=device, dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    row_prompt = [p for p, o in enumerate(per_prompt) for _ in range(o.n)]  # the prompt of each row
    expand = torch.tensor(row_prompt, device=device) if len(row_prompt) > len(per_prompt) else None

    from transformers import DynamicCache

    cache = applied.cache if applied.cache is not None else DynamicCache()
    if expand is not None and not options.share_prompt_kv:  # the reference: each row's prompt prefilled
        input_ids = None if input_ids is None else input_ids[expand]
        inputs_embeds = None if inputs_embeds is None else inputs_embeds[expand]
        mask, positions = mask[expand], positions[expand]
    mask = applied.mask(mask)  # a prefix's positions in front; position ids count the prompt's own tokens
    out = model(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last_positions(1, inputs.shape[1], device),
    )
    logits = out.logits[:, -1, :]
    if expand is not None and options.share_prompt_kv:  # one prefill per prompt, its KV repeated per row
        cache.batch_select_indices(expand)
        logits, mask, positions = logits[expand], mask[expand], positions[expand]

    rows = len(row_prompt)
    limit = [per_prompt[p].max_new_tokens for p in row_prompt]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    reasons = ["length"] * rows
    live = list(range(rows))  # the original row of each batch position
    alive = [True] * rows  # per batch position; only False for kept finished rows (drop_finished off)
    next_pos = positions[:, -1] + 1
    for _ in range(max(limit)):
        picked = _pick(logits, live, alive, row_prompt, per_prompt, generators)
        picked_list = picked.tolist()
        is_eos = torch.isin(picked, eos).tolist()
        for b, row in enumerate(live):
            if not alive[b]:
                continue
            tok = picked_list[b]
            tokens[row].append(tok)
            if is_eos[b]:
                reasons[row], alive[b] = "stop", False
            elif should_stop is not None and should_stop(row, tokens[row], tok):
                reasons[row], alive[b] = "answer", False
            elif len(tokens[row]) >= limit[row]:
                alive[b] = False  # its reason stays "length"
        if not any(alive):
            break
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype, device=device)], dim=1)
        if options.drop_finished and not all(alive):
            keep = [b for b, a in enumerate(alive) if a]
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            mask, next_pos, picked = mask[idx], next_pos[idx], picked[idx]
            live, alive = [live[b] for b in keep], [True] * len(keep)
        out = model(
            input_ids=picked.unsqueeze(1),
            attention_mask=mask,
            position_ids=next_pos.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return list(zip(tokens, reasons, strict=True))


def _pick(
    logits: torch.Tensor,
    live: list[int],
    alive: list[bool],
    row_prompt: list[int],
    per_prompt: list[DecodeOptions],
    generators: Sequence[torch.Generator | None] | None,
) -> torch.Tensor:
    """One token per batch row, under its prompt's options (rows of prompts with other options
    than the first are picked as a group of their own: greedy rows take no random draw)."""
    first = per_prompt[0]
    if all(o.temperature == first.temperature and o.top_p == first.top_p for o in per_prompt):
        return _pick_rows(logits, live, alive, row_prompt, first, generators)
    picked = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    groups: dict[tuple[float, float], list[int]] = {}
    for b, row in enumerate(live):
        o = per_prompt[row_prompt[row]]
        groups.setdefault((o.temperature, o.top_p), []).append(b)
    for positions in groups.values():
        o = per_prompt[row_prompt[live[positions[0]]]]
        idx = torch.tensor(positions, device=logits.device)
        sub_live, sub_alive = [live[b] for b in positions], [alive[b] for b in positions]
        picked[idx] = _pick_rows(logits[idx], sub_live, sub_alive, row_prompt, o, generators)
    return picked


def _pick_rows(
    logits: torch.Tensor,
    live: list[int],
    alive: list[bool],
    row_prompt: list[int],
    options: DecodeOptions,
    generators: Sequence[torch.Generator | None] | None,
) -> torch.Tensor:
    """One token per batch row: greedy, or sampled at the temperature (nucleus when top_p < 1).

    Sampling inverts each row's CDF at a uniform draw. The draws come from each prompt's own
    generator (a handful of numbers per step), the inversion is one vectorised search over the
    whole batch: per-prompt seeds cost no per-prompt pass over the vocabulary.
    """
    if options.temperature <= 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / options.temperature, dim=-1)
    if options.top_p < 1.0:
        probs = _nucleus(probs, options.top_p)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(1)
    u = torch.zeros(probs.shape[0], dtype=torch.float64)
    by_prompt: dict[int, list[int]] = {}
    for b, row in enumerate(live):
        if alive[b]:
            by_prompt.setdefault(row_prompt[row], []).append(b)
    for prompt, batch_rows in by_prompt.items():
        gen = generators[prompt]
        device = gen.device if gen is not None else "cpu"
        u[batch_rows] = torch.rand(len(batch_rows), generator=gen, dtype=torch.float64, device=device).cpu()
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    # right=True: the first token whose CDF exceeds the draw, so a zero-probability token is never picked
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    sorted_p[(cum - sorted_p) > top_p] = 0.0  # keep the smallest prefix whose mass reaches top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
