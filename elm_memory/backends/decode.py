"""A sampling loop for the transformers backend, shaped for GRPO rollouts on a CPU.

``model.generate`` with ``num_return_sequences=n`` copies each prompt n times *before*
the prefill and keeps finished rows in the batch until the longest one ends. For G=8
rollouts of a 150-token prompt that is 8x the prefill work, and with ``stop_at_answer``
most rows are padding long before the batch ends. This loop:

- **prefills each prompt once** and repeats its KV cache n times (``share_prompt_kv``);
- **drops finished rows** from the batch and the cache (``drop_finished``), so a step
  costs what the live rows cost;
- **samples each prompt from its own seed**: a row's draws are a hash of a key drawn from its
  prompt's generator and the token's index (:mod:`elm_memory.backends.sampling`), so a prompt's
  rollouts depend on its seed only, not on which other prompts share the batch (what training
  several memories together needs to equal training each alone) or on lookup drafts.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.backends import packed_attention
from elm_memory.backends.lookup import LookupDrafter
from elm_memory.backends.sampling import RowChoice, pick_tokens
from elm_memory.memory.kinds import LORA, LORA_ROWS, AppliedMemory
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
    lookup_max_rows: int = 8  # a call with more rows decodes without drafts (wide forwards cost more than they save)


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
    ``"length"``. ``generators[i]`` draws the keys of prompt i's rows, one per row at the start
    (None: the global RNG); each sampled token is then the row's (key, token index) draw.
    ``memory``: a lora/prefix memory applied to every row (a prefix starts the KV cache).

    ``options`` may be one per prompt: prompt i then gets ``options[i].n`` rows, decoded at its
    own temperature, top-p and length (``share_prompt_kv``/``drop_finished``/``lookup_draft_tokens``
    are the first's). A prompt's rows and random draws are the ones it gets in a batch of its own.

    ``lookup_draft_tokens`` > 0 turns on speculative decoding (:mod:`elm_memory.backends.lookup`):
    ``prompt_tokens[i]`` (prompt i's token ids; default the ``input_ids`` rows) and
    ``earlier_outputs[i]`` (outputs generated before for that prompt) seed the lookup.
    Rows keep their tokens, greedy and sampled (up to bf16 rounding: a forward of several tokens
    rounds differently): a sampled token's draw depends on the row's key and the token's index only.

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
            captured if memory is None or memory.kind not in (LORA, LORA_ROWS) else None,
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
    packed_attention.install()  # decode steps read each key/value head once (asked for with REQUEST)
    inputs = input_ids if input_ids is not None else inputs_embeds
    assert inputs is not None
    options = per_prompt[0]
    row_prompt = [p for p, o in enumerate(per_prompt) for _ in range(o.n)]  # the prompt of each row
    if len(row_prompt) > options.lookup_max_rows or applied.on_rows is not None:  # lookup drops rows its own way
        options = replace(options, lookup_draft_tokens=0)
    if options.lookup_draft_tokens > 0 and prompt_tokens is None and input_ids is not None:
        pairs = zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
        prompt_tokens = [[t for t, m in zip(ids, keep, strict=True) if m] for ids, keep in pairs]
    device = inputs.device
    mask = attention_mask.to(device=device, dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    expand = torch.tensor(row_prompt, device=device) if len(row_prompt) > len(per_prompt) else None

    from elm_memory.backends import growing_cache

    cache = applied.cache if applied.cache is not None else growing_cache.GrowingCache()
    if expand is not None and not options.share_prompt_kv:  # the reference: each row's prompt prefilled
        input_ids = None if input_ids is None else input_ids[expand]
        inputs_embeds = None if inputs_embeds is None else inputs_embeds[expand]
        mask, positions = mask[expand], positions[expand]
        applied.select_rows(expand)
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
        applied.select_rows(expand)
        logits, mask, positions = logits[expand], mask[expand], positions[expand]

    choice = RowChoice.of(row_prompt, per_prompt, generators, device)
    if options.lookup_draft_tokens > 0:
        if prompt_tokens is None:
            raise ValueError("speculative lookup with inputs_embeds needs prompt_tokens")
        drafter = LookupDrafter(prompt_tokens, row_prompt, options.lookup_draft_tokens, earlier_outputs)
        return _decode_lookup(
            model, cache, logits, mask, positions, row_prompt, per_prompt, drafter, eos, choice, should_stop
        )
    if captured is not None:
        done = captured.decode(cache, logits, mask, positions, row_prompt, per_prompt, eos, choice, should_stop)
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
    temperature, top_p, keys = choice.temperature, choice.top_p, choice.keys
    for step in range(max(limit)):
        # every live row has emitted ``step`` tokens: its draw for the next one is its (key, step) draw
        counts = torch.full((len(live),), step, dtype=torch.long, device=device)
        picked = choice.pick(logits, temperature, top_p, keys, counts)
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
            applied.select_rows(idx)
            mask, next_pos, picked = mask[idx], next_pos[idx], picked[idx]
            temperature, top_p, keys = temperature[idx], top_p[idx], keys[idx]
            live, alive = [live[b] for b in keep], [True] * len(keep)
        out = model(
            input_ids=picked.unsqueeze(1),
            attention_mask=mask,
            position_ids=next_pos.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
            **packed_attention.REQUEST,
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
    choice: RowChoice,
    should_stop: Callable[[int, list[int], int], bool] | None,
) -> list[tuple[list[int], str]]:
    """The decode steps with speculative lookup: each live row feeds its next token plus up to k
    drafted ones (one forward for all), keeps the drafts the model agrees with and the model's own
    token after them. Rejected drafts stay in the KV cache, masked out, so no row waits for another.

    Acceptance: a greedy row takes a draft that is its argmax; a sampled row draws its token from ``p``
    with its draw for that token's index and keeps the draft when that token is the draft (probability
    ``p(d)``), so its tokens are those of plain sampling whatever was drafted."""
    device = mask.device
    eos_set = set(eos.tolist())
    rows = len(row_prompt)
    limit = [per_prompt[p].max_new_tokens for p in row_prompt]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    reasons = ["length"] * rows
    live = list(range(rows))
    next_pos = positions[:, -1] + 1
    # the first token of every row comes from the prefill's logits, as without lookup
    zero = torch.zeros(rows, dtype=torch.long, device=device)
    first = choice.pick(logits, choice.temperature, choice.top_p, choice.keys, zero).tolist()
    keys = choice.keys.tolist()
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
            input_ids=feed.to(device),
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            **packed_attention.REQUEST,
        )
        accepted, picked, alive = [], [], []
        for b, row in enumerate(live):
            opts = per_prompt[row_prompt[row]]
            took, nxt = _verify(out.logits[b], drafts[b], opts, keys[row], len(tokens[row]))
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
    logits: torch.Tensor, draft: list[int], options: DecodeOptions, key: int, emitted: int
) -> tuple[list[int], int]:
    """(the accepted prefix of ``draft``, the model's token after it) from one row's logits
    ``[1 + len(draft) or more, vocab]`` (position j scores the token after input j); ``key``: the row's
    draw key, ``emitted``: the tokens the row has so far (the index of the token position 0 chooses)."""
    n = len(draft)
    if options.temperature <= 0.0:
        best = logits[: n + 1].argmax(dim=-1).tolist()
        a = 0
        while a < n and best[a] == draft[a]:
            a += 1
        return draft[:a], best[a]
    # Position a chooses the row's token number emitted + a, with that token's own draw, inverted at the
    # model's distribution there: a draft is kept when the drawn token is the draft (probability p(draft),
    # as the textbook rule), and every token is the one plain sampling gives the row, whatever was drafted.
    positions = n + 1
    choice = pick_tokens(
        logits[:positions],
        torch.full((positions,), options.temperature, dtype=torch.float32, device=logits.device),
        torch.full((positions,), options.top_p, dtype=torch.float32, device=logits.device),
        torch.full((positions,), key, dtype=torch.long, device=logits.device),
        torch.arange(emitted, emitted + positions, device=logits.device),
        any_sampled=True,
        any_nucleus=options.top_p < 1.0,
        any_greedy=False,  # every position samples: no argmax pass over the vocabulary
    ).tolist()
    for a in range(n):
        if choice[a] != draft[a]:
            return draft[:a], choice[a]
    return draft, choice[n]
