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

With ``lookup_draft_tokens`` it also **decodes speculatively** from drafts looked up in the text
already there (:mod:`elm_memory.backends.lookup`): several tokens per row per forward, where the
model agrees with the guess.

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
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.backends.lookup import LookupDrafter
from elm_memory.memory.kinds import AppliedMemory
from elm_memory.models.logits import last_positions

if TYPE_CHECKING:
    from elm_memory.backends.captured import CapturedSteps
    from elm_memory.memory.kinds import MemoryAdapter


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    n: int = 1
    share_prompt_kv: bool = True
    drop_finished: bool = True
    lookup_draft_tokens: int = 0  # >0: speculative decoding with drafts looked up in the rows' text


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
    prompt_tokens: Sequence[Sequence[int]] | None = None,
    earlier_outputs: Sequence[Sequence[Sequence[int]]] = (),
    captured: CapturedSteps | None = None,
) -> list[tuple[list[int], str]]:
    """Generate ``options.n`` continuations of each left-padded prompt in the batch.

    Returns ``B * n`` rows (prompt-major: the n samples of prompt 0 first), each as
    ``(new token ids, finish reason)``; the reason is ``"stop"`` (an EOS token, included in
    the ids), ``"answer"`` (``should_stop(row, tokens, token)`` said so after ``token``) or
    ``"length"``. ``generators[i]`` draws prompt i's samples (None: the global RNG).
    ``memory``: a lora/prefix memory applied to every row (a prefix starts the KV cache).

    ``options`` may be one per prompt: prompt i then gets ``options[i].n`` rows, decoded at its
    own temperature, top-p and length (``share_prompt_kv``/``drop_finished``/``lookup_draft_tokens``
    are the first's). A prompt's rows and random draws are the ones it gets in a batch of its own.

    ``lookup_draft_tokens`` > 0 turns on speculative decoding (:mod:`elm_memory.backends.lookup`):
    ``prompt_tokens[i]`` (prompt i's token ids; default the ``input_ids`` rows) and
    ``earlier_outputs[i]`` (outputs generated before for that prompt) seed the lookup.
    Greedy rows keep their tokens (up to bf16 rounding: a forward of several tokens rounds
    differently); sampled rows keep their distribution, not their draws.

    ``captured``: decode steps on a static KV cache, compiled once per shape bucket
    (:mod:`elm_memory.backends.captured`); the prefill and every token choice stay the ones here.
    A LoRA memory (forward hooks) or lookup drafts take this loop instead.
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
            model,
            attention_mask,
            per_prompt,
            applied,
            input_ids,
            inputs_embeds,
            eos_ids,
            generators,
            should_stop,
            prompt_tokens,
            earlier_outputs,
            captured if memory is None or memory.kind != "lora" else None,
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
    prompt_tokens: Sequence[Sequence[int]] | None = None,
    earlier_outputs: Sequence[Sequence[Sequence[int]]] = (),
    captured: CapturedSteps | None = None,
) -> list[tuple[list[int], str]]:
    """:func:`sample` under an applied memory (whose cache, if any, already holds a prefix)."""
    inputs = input_ids if input_ids is not None else inputs_embeds
    assert inputs is not None
    options = per_prompt[0]
    if options.lookup_draft_tokens > 0 and prompt_tokens is None and input_ids is not None:
        pairs = zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
        prompt_tokens = [[t for t, m in zip(ids, keep, strict=True) if m] for ids, keep in pairs]
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

    if options.lookup_draft_tokens > 0:
        if prompt_tokens is None:
            raise ValueError("speculative lookup with inputs_embeds needs prompt_tokens")
        drafter = LookupDrafter(prompt_tokens, row_prompt, options.lookup_draft_tokens, earlier_outputs)
        return _decode_lookup(
            model, cache, logits, mask, positions, row_prompt, per_prompt, drafter, eos, generators, should_stop
        )
    if captured is not None:
        done = captured.decode(cache, logits, mask, positions, row_prompt, per_prompt, eos, generators, should_stop)
        if done is not None:  # None: no bucket fits, or another call holds the caches; the plain loop decodes it
            return done
    rows = len(row_prompt)
    limit = [per_prompt[p].max_new_tokens for p in row_prompt]
    eos_set = set(eos.tolist())
    tokens: list[list[int]] = [[] for _ in range(rows)]
    reasons = ["length"] * rows
    live = list(range(rows))  # the original row of each batch position
    alive = [True] * rows  # per batch position; only False for kept finished rows (drop_finished off)
    next_pos = positions[:, -1] + 1
    for _ in range(max(limit)):
        picked = _pick(logits, live, alive, row_prompt, per_prompt, generators)
        picked_list = picked.tolist()
        for b, row in enumerate(live):
            if alive[b]:
                alive[b] = _append(row, picked_list[b], tokens, reasons, limit, eos_set, should_stop)
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


def _decode_lookup(
    model: torch.nn.Module,
    cache: Any,
    logits: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    row_prompt: list[int],
    per_prompt: list[DecodeOptions],
    drafter: LookupDrafter,
    eos: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None,
    should_stop: Callable[[int, list[int], int], bool] | None,
) -> list[tuple[list[int], str]]:
    """The decode steps with speculative lookup: each live row feeds its next token plus up to k
    drafted ones (one forward for all), keeps the drafts the model agrees with and the model's own
    token after them. Rejected drafts stay in the KV cache, masked out, so no row waits for another.

    Acceptance: a greedy row takes a draft that is its argmax; a sampled row draws its token from ``p``
    with one draw of its generator and keeps the draft when that token is the draft (probability
    ``p(d)``), so its tokens and draws are those of plain sampling whatever was drafted."""
    device = mask.device
    eos_set = set(eos.tolist())
    rows = len(row_prompt)
    limit = [per_prompt[p].max_new_tokens for p in row_prompt]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    reasons = ["length"] * rows
    live = list(range(rows))
    next_pos = positions[:, -1] + 1
    # the first token of every row comes from the prefill's logits, as without lookup
    first = _pick(logits, live, [True] * rows, row_prompt, per_prompt, generators).tolist()
    picked: list[int] = []
    alive: list[bool] = []
    for row, tok in enumerate(first):
        alive.append(_append(row, tok, tokens, reasons, limit, eos_set, should_stop))
        picked.append(tok)
        drafter.extend(row, [tok])
    while any(alive):
        keep = [b for b, a in enumerate(alive) if a]
        if len(keep) < len(live):
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            mask, next_pos = mask[idx], next_pos[idx]
            live, picked = [live[b] for b in keep], [picked[b] for b in keep]
        drafts = [drafter.draft(row, limit[row] - len(tokens[row]) - 1) for row in live]
        width = 1 + max(len(d) for d in drafts)
        feed = torch.tensor([[p, *d] + [p] * (width - 1 - len(d)) for p, d in zip(picked, drafts, strict=True)])
        step_pos = next_pos.unsqueeze(1) + torch.arange(width, device=device)
        mask = torch.cat([mask, torch.ones(mask.shape[0], width, dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=feed.to(device), attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=True
        )
        accepted, picked, alive = [], [], []
        for b, row in enumerate(live):
            opts = per_prompt[row_prompt[row]]
            gen = generators[row_prompt[row]] if generators is not None else None
            took, nxt = _verify(out.logits[b], drafts[b], opts, gen)
            done = False
            for tok in took:  # the accepted drafts; the row may end on one of them
                done = not _append(row, tok, tokens, reasons, limit, eos_set, should_stop)
                if done:
                    break
            drafter.extend(row, took)
            if not done:
                done = not _append(row, nxt, tokens, reasons, limit, eos_set, should_stop)
                drafter.extend(row, [nxt])
            accepted.append(len(took))
            picked.append(nxt)
            alive.append(not done)
        # inputs past each row's accepted drafts were guesses the model refused: masked from now on
        for b, a in enumerate(accepted):
            if 1 + a < width:
                mask[b, mask.shape[1] - width + 1 + a :] = 0
        next_pos = next_pos + 1 + torch.tensor(accepted, device=device)
    return list(zip(tokens, reasons, strict=True))


def _append(
    row: int,
    tok: int,
    tokens: list[list[int]],
    reasons: list[str],
    limit: list[int],
    eos_set: set[int],
    should_stop: Callable[[int, list[int], int], bool] | None,
) -> bool:
    """Add ``tok`` to ``row``; False when the row ends with it (its reason set as the plain loop does)."""
    tokens[row].append(tok)
    if tok in eos_set:
        reasons[row] = "stop"
        return False
    if should_stop is not None and should_stop(row, tokens[row], tok):
        reasons[row] = "answer"
        return False
    return len(tokens[row]) < limit[row]


def _verify(
    logits: torch.Tensor, draft: list[int], options: DecodeOptions, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(the accepted prefix of ``draft``, the model's token after it) from one row's logits
    ``[1 + len(draft) or more, vocab]`` (position j scores the token after input j)."""
    n = len(draft)
    if options.temperature <= 0.0:
        best = logits[: n + 1].argmax(dim=-1).tolist()
        a = 0
        while a < n and best[a] == draft[a]:
            a += 1
        return draft[:a], best[a]
    probs = torch.softmax(logits[: n + 1].float() / options.temperature, dim=-1)
    if options.top_p < 1.0:
        probs = _nucleus(probs, options.top_p)
    # One draw per position, inverted at the model's distribution there, keeps a draft when the drawn token
    # is the draft (probability p(draft), as the textbook rule). Every token costs exactly one draw whatever
    # was drafted, so a prompt with one seeded row gets the tokens plain sampling gives it, whatever the
    # drafts. With n rows the prompt's generator is shared: rows that emit more tokens per forward take
    # more draws, so drafts move draws between rows (the distribution is unchanged, the rows are not;
    # tests/test_lookup_seeding.py).
    for a in range(n):
        token = _draw(probs[a], generator)
        if token != draft[a]:
            return draft[:a], token
    return draft, _draw(probs[n], generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised ``probs`` by inverting its CDF at a draw of ``generator``."""
    device = generator.device if generator is not None else "cpu"
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=device).cpu()
    return int(_inverse_cdf(probs.unsqueeze(0), u)[0])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalised ``probs`` [B, V], the token where its CDF first exceeds ``u`` [B] (in [0, 1))
    times the row's mass."""
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    # right=True: the first token whose CDF exceeds the draw, so a zero-probability token is never picked
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


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
    # the draws stay on the logits' device: a copy to the host per prompt would wait for the GPU each step
    u = torch.zeros(probs.shape[0], dtype=torch.float64, device=probs.device)
    by_prompt: dict[int, list[int]] = {}
    for b, row in enumerate(live):
        if alive[b]:
            by_prompt.setdefault(row_prompt[row], []).append(b)
    for prompt, batch_rows in by_prompt.items():
        gen = generators[prompt]
        device = gen.device if gen is not None else "cpu"
        draws = torch.rand(len(batch_rows), generator=gen, dtype=torch.float64, device=device).to(u.device)
        first, last = batch_rows[0], batch_rows[-1]
        if last - first + 1 == len(batch_rows):  # a prompt's live rows sit together unless some finished in place
            u[first : last + 1] = draws
        else:
            u[torch.tensor(batch_rows, device=u.device)] = draws
    return _inverse_cdf(probs, u)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    sorted_p[(cum - sorted_p) > top_p] = 0.0  # keep the smallest prefix whose mass reaches top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
