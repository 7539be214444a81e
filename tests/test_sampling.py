"""Token choice with counter-based draws (elm_memory/backends/sampling.py): the hash is exact integer
arithmetic, its draws are uniform and independent of each other, and sampling follows the softmax."""

from __future__ import annotations

import random

import pytest
import torch

from elm_memory.backends.sampling import (
    inverse_cdf,
    mix32,
    nucleus,
    pick_tokens,
    row_keys,
    uniforms,
)

M32 = 0xFFFFFFFF


def _mix32_reference(x: int) -> int:
    """The same mixer on Python's unbounded integers: what the int64 tensor version must equal bit for bit."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_the_mixer_equals_unbounded_integer_arithmetic_at_the_edges_of_32_bits():
    rng = random.Random(0)
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32] + [
        rng.getrandbits(32) for _ in range(5000)
    ]
    got = mix32(torch.tensor(values, dtype=torch.long)).tolist()
    assert got == [_mix32_reference(v) for v in values]
    assert len(set(got)) == len(set(values))  # a bijection: no two inputs meet


def test_draws_are_uniform_in_0_1_and_independent_of_the_previous_token():
    keys = torch.arange(400, dtype=torch.long).repeat_interleave(250) * 7919 + 12345
    counts = torch.arange(250, dtype=torch.long).repeat(400)
    u = uniforms(keys, counts)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    n, bins = u.numel(), 50
    observed = torch.histc(u, bins=bins, min=0.0, max=1.0)
    chi2 = float(((observed - n / bins) ** 2 / (n / bins)).sum())
    assert chi2 < 110, chi2  # 49 degrees of freedom: above 110 has probability below 1e-6 for uniform draws
    # consecutive tokens of one row: each of the four quadrants holds a quarter of the pairs
    grid = u.view(400, 250)
    first, second = grid[:, :-1].flatten() < 0.5, grid[:, 1:].flatten() < 0.5
    both = float((first & second).float().mean())
    assert abs(both - 0.25) < 0.01, both


def test_a_draw_is_a_function_of_its_key_and_index_alone():
    keys = torch.tensor([5, 5, 6, 5], dtype=torch.long)
    counts = torch.tensor([0, 1, 0, 0], dtype=torch.long)
    u = uniforms(keys, counts).tolist()
    assert u[0] == u[3] and u[0] != u[1] and u[0] != u[2]
    assert uniforms(keys[3:], counts[3:]).tolist() == [u[3]]  # alone or in a batch: the same number


@pytest.mark.slow
def test_the_compiled_hash_gives_the_same_bits():
    """Captured decode steps compile :func:`uniforms` into one kernel: its draws must be the eager ones."""
    rng = random.Random(1)
    keys = torch.tensor([0, M32, 0x80000000] + [rng.getrandbits(32) for _ in range(509)], dtype=torch.long)
    counts = torch.tensor([0, 1, 4095] + [rng.randrange(1 << 20) for _ in range(509)], dtype=torch.long)
    compiled = torch.compile(uniforms, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(keys, counts), uniforms(keys, counts))
    probs = torch.softmax(torch.randn(512, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    flags = {"any_sampled": True, "any_nucleus": False, "any_greedy": False}
    ones = torch.ones(512)
    assert torch.equal(
        pick_tokens(probs.log(), ones, ones, keys, counts, draws=compiled, **flags),
        pick_tokens(probs.log(), ones, ones, keys, counts, **flags),
    )


def test_inverse_cdf_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.3, 0.0, 0.7], [0.2, 0.0, 0.0, 0.0]])
    top = torch.full((3,), 1.0 - 2.0**-24)  # the largest draw there is
    assert inverse_cdf(probs, top).tolist() == [1, 3, 0]
    assert inverse_cdf(probs, torch.zeros(3)).tolist() == [0, 1, 0]
    assert inverse_cdf(probs, torch.full((3,), 0.5)).tolist() == [1, 3, 0]


def test_sampled_tokens_follow_the_softmax_and_greedy_rows_take_the_argmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    rows = logits.repeat(n, 1)
    temperature = torch.full((n,), 0.8)
    temperature[::2] = 0.0  # every other row greedy
    keys = torch.arange(n, dtype=torch.long)
    picked = pick_tokens(
        rows, temperature, torch.ones(n), keys, torch.zeros(n, dtype=torch.long), any_sampled=True, any_nucleus=False
    )
    assert set(picked[::2].tolist()) == {0}
    sampled = torch.bincount(picked[1::2], minlength=5).float() / (n // 2)
    assert torch.allclose(sampled, torch.softmax(logits / 0.8, dim=-1), atol=0.015)
    greedy_only = pick_tokens(
        rows[:3], torch.zeros(3), torch.ones(3), keys[:3], keys[:3], any_sampled=False, any_nucleus=False
    )
    assert greedy_only.tolist() == [0, 0, 0]


def test_the_nucleus_is_per_row():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    kept = nucleus(probs, torch.tensor([0.6, 1.0]))
    assert torch.equal(kept, torch.tensor([[0.5, 0.3, 0.0], [0.5, 0.3, 0.2]]))


def test_keys_come_from_each_sampled_prompts_own_generator_and_greedy_prompts_draw_none():
    def gens(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    together = row_keys([0, 0, 1, 2, 2], [True, False, True], gens(1, 2, 3), "cpu").tolist()
    assert together[2] == 0  # the greedy prompt's row has no key
    assert together[:2] == row_keys([0, 0], [True], gens(1), "cpu").tolist()
    assert together[3:] == row_keys([0, 0], [True], gens(3), "cpu").tolist()
    untouched = gens(2)
    row_keys([0, 1], [True, False], [gens(1)[0], untouched[0]], "cpu")
    assert torch.rand(1, generator=untouched[0]).item() == torch.rand(1, generator=gens(2)[0]).item()


def test_the_two_level_inverse_cdf_lands_where_the_cdf_crosses_the_draw():
    """Blocks of 128 then the token inside: the picked token has mass and its CDF interval holds the
    draw (within float32 rounding of a block's sum), and it is the token a float64 scan over the whole
    vocabulary picks on all but rounding ties; vocabularies that are and are not a multiple of 128."""
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 1000):
        probs = torch.softmax(torch.randn(16, vocab, generator=g) * 4, dim=-1)
        probs[:, 5:300] = 0.0  # whole blocks and parts of blocks without mass
        same = draws = 0
        for _ in range(200):
            u = torch.rand(16, generator=g)
            picked = inverse_cdf(probs, u)
            cdf = probs.double().cumsum(dim=-1)
            target = u.double() * cdf[:, -1]
            rows = torch.arange(16)
            upper = cdf[rows, picked]
            lower = upper - probs[rows, picked].double()
            assert (probs[rows, picked] > 0).all()
            assert ((lower <= target + 1e-7) & (target <= upper + 1e-7)).all()
            flat = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
            same, draws = same + int((picked == flat).sum()), draws + 16
        assert same >= draws - 3, f"{draws - same} of {draws} draws differ from the flat scan"


def test_a_batch_with_no_greedy_row_skips_the_argmax_and_picks_the_same_tokens():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    temperature, top_p = torch.full((6,), 0.7), torch.full((6,), 0.9)
    keys, counts = torch.arange(6, dtype=torch.long) * 11, torch.full((6,), 4, dtype=torch.long)
    both = [
        pick_tokens(logits, temperature, top_p, keys, counts, any_sampled=True, any_nucleus=True, any_greedy=g)
        for g in (True, False)
    ]
    assert torch.equal(both[0], both[1])


def test_the_choice_scales_a_copy_and_gives_the_plain_softmaxs_tokens():
    """The temperature is applied in place on a float32 copy: float32 logits are left as they were, and the
    tokens are those of ``softmax(logits.float() / t)`` inverted at the same draws."""
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(16, 500, generator=g)
    before = logits.clone()
    temperature = torch.rand(16, generator=g) + 0.3
    keys, counts = torch.randint(0, 1 << 32, (16,), generator=g), torch.arange(16)
    flags = {"any_sampled": True, "any_nucleus": False, "any_greedy": False}
    picked = pick_tokens(logits, temperature, torch.ones(16), keys, counts, **flags)
    assert torch.equal(logits, before)
    plain = inverse_cdf(torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1), uniforms(keys, counts))
    assert torch.equal(picked, plain)
