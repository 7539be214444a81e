"""Token choice for the decode loops: greedy, or sampled with counter-based draws.

Each sampled row gets a 32-bit **key** when its call starts, drawn from its prompt's generator (one
draw per row, whatever happens later). The draw for the row's t-th token is a hash of (key, t): a
pure function, not the next number of a shared stream. So:

- a row's tokens depend on its prompt's seed and its own position only, never on how many tokens
  other rows took, how many tokens a forward emitted (lookup drafts) or how often the loop looked
  at the tokens (the captured path reads them back every few steps);
- the draws can be made on the device inside a captured step, with no generator and no host round
  trip.

The hash is an integer mixer on 32-bit values held in int64 tensors; every product stays below
2**63, so it gives the same bits on any device, eager or compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elm_memory.backends.decode import DecodeOptions

MASK32 = 0xFFFFFFFF
KEY_BOUND = 1 << 32
BLOCK = 128  # tokens per block of the two-level inverse CDF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` below 2**32, without an int64 overflow (split in 16-bit halves)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mix of 32-bit values (xor-shift, multiply, twice)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """float32 draws in [0, 1), one per row: the draw of the row with key ``keys[i]`` for its
    ``counts[i]``-th token. 24 bits, so every value is exact in float32 and below 1."""
    bits = mix32(keys ^ mix32((counts * 0x9E3779B9 + 0x632BE5AB) & MASK32))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def row_keys(
    row_prompt: Sequence[int],
    sampled: Sequence[bool],
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device | str,
) -> torch.Tensor:
    """One key per output row (int64, on ``device``): each sampled prompt's rows draw theirs from the
    prompt's generator (None or no generators: the global one), in row order, as one call. Greedy
    prompts draw nothing, so a greedy answer beside rollouts leaves every generator where it was."""
    keys = torch.zeros(len(row_prompt), dtype=torch.long)
    rows_of: dict[int, list[int]] = {}
    for row, prompt in enumerate(row_prompt):
        if sampled[prompt]:
            rows_of.setdefault(prompt, []).append(row)
    for prompt, rows in rows_of.items():
        gen = generators[prompt] if generators is not None else None
        where = gen.device if gen is not None else "cpu"
        drawn = torch.randint(0, KEY_BOUND, (len(rows),), generator=gen, dtype=torch.long, device=where)
        keys[rows] = drawn.cpu()
    return keys.to(device)


def tempered(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``logits.float() / temperature``, the same values, as one new float32 tensor divided in place: a
    buffer of the logits' size fewer, and never the caller's tensor (float32 logits are copied too).
    The sampler's distribution, and the one teacher forcing scores rollouts under."""
    return logits.to(torch.float32, copy=True).div_(temperature)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalised ``probs`` [B, V], the first token whose CDF exceeds ``u`` [B] (in [0, 1))
    times the row's mass. A zero-probability token is never picked, even where rounding puts the
    target at the end of the mass (the last token with mass is taken then).

    In two levels, in float64 where sums run long: the CDF over blocks of ``BLOCK`` tokens finds the
    block, then the CDF inside that block finds the token. In exact arithmetic this is the plain
    inverse CDF; it reads the vocabulary once (a block sum), where a vocabulary-long scan took 0.23 ms a
    step on an H200 and grows with the rows on a CPU. float64 matters: in float32 a running sum near
    0.2 moves in steps of 1.5e-8, so the tail's tiny probabilities bump it by a whole step or by
    nothing, and which tail token a draw lands on turned on the last bit of a logit."""
    rows, vocab = probs.shape
    pad = (-vocab) % BLOCK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1:].contiguous()
    target = u.double().unsqueeze(1) * total
    block = torch.minimum(
        torch.searchsorted(block_cdf, target, right=True), torch.searchsorted(block_cdf, total, right=False)
    )
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, BLOCK)).squeeze(1).double().cumsum(dim=-1)
    token = torch.minimum(
        torch.searchsorted(inside, target - before, right=True),
        torch.searchsorted(inside, inside[:, -1:].contiguous(), right=False),
    )
    return (block * BLOCK + token).squeeze(1)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest prefix of its most likely tokens whose mass reaches ``top_p[row]``."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def pick_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    counts: torch.Tensor,
    *,
    any_sampled: bool,
    any_nucleus: bool,
    any_greedy: bool = True,
    draws: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: the argmax where ``temperature[row] <= 0``, else a draw
    at that temperature (and ``top_p[row]``) by inverting the row's CDF at ``uniforms(keys, counts)``.

    ``any_sampled`` / ``any_nucleus`` / ``any_greedy`` are the host's knowledge of the batch (no row
    sampled: no softmax; no top_p below 1: no sort; no greedy row: no argmax, which costs as much as the
    softmax on a CPU), so the function never branches on device values. ``draws``: what computes
    :func:`uniforms` (a compiled copy: the same bits, one kernel instead of a few dozen)."""
    if not any_sampled:
        return logits.argmax(dim=-1)
    if any_greedy:
        greedy = temperature <= 0
        scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    else:
        scale = temperature
    probs = torch.softmax(tempered(logits, scale.unsqueeze(1)), dim=-1)
    if any_nucleus:
        probs = nucleus(probs, top_p)
    drawn = inverse_cdf(probs, (draws or uniforms)(keys, counts))
    return torch.where(greedy, logits.argmax(dim=-1), drawn) if any_greedy else drawn


@dataclass(frozen=True)
class RowChoice:
    """How each output row picks its tokens: per-row temperature and top-p, and the row's draw key
    (see above); all on the logits' device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    keys: torch.Tensor
    any_sampled: bool
    any_nucleus: bool
    any_greedy: bool

    @staticmethod
    def of(
        row_prompt: Sequence[int],
        per_prompt: Sequence[DecodeOptions],
        generators: Sequence[torch.Generator | None] | None,
        device: torch.device,
    ) -> RowChoice:
        sampled = [o.temperature > 0.0 for o in per_prompt]
        temps = [max(per_prompt[p].temperature, 0.0) for p in row_prompt]
        tops = [per_prompt[p].top_p for p in row_prompt]
        return RowChoice(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p=torch.tensor(tops, dtype=torch.float32, device=device),
            keys=row_keys(row_prompt, sampled, generators, device),
            any_sampled=any(sampled),
            any_nucleus=any(o.top_p < 1.0 for o, s in zip(per_prompt, sampled, strict=True) if s),
            any_greedy=not all(sampled[p] for p in row_prompt),
        )

    def pick(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        keys: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """One token per row of ``logits``, the rows' settings and keys given (a subset of this call's rows)."""
        return pick_tokens(
            logits,
            temperature,
            top_p,
            keys,
            counts,
            any_sampled=self.any_sampled,
            any_nucleus=self.any_nucleus,
            any_greedy=self.any_greedy,
        )

    @property
    def flags(self) -> dict[str, bool]:
        """What the host knows of the rows, for :func:`sampling.pick_tokens`."""
        return {"any_sampled": self.any_sampled, "any_nucleus": self.any_nucleus, "any_greedy": self.any_greedy}
