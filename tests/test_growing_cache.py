"""The in-place KV cache (``backends/growing_cache.py``) holds what transformers' ``DynamicCache`` holds,
through every operation the decode loops use: prefill, one-token and multi-token appends (lookup
drafts), rows repeated per prompt, rows dropped, crops; and a decode gives the same tokens."""

from __future__ import annotations

import pytest
import torch
from _fakes import tiny_qwen2_config
from transformers import DynamicCache

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.backends.growing_cache import RESERVE, GrowingCache


def _states(g: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, length, 8, generator=g), torch.randn(batch, 2, length, 8, generator=g)


def _same(a: DynamicCache, b: DynamicCache) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_holds_what_a_dynamic_cache_holds_through_appends_repeats_drops_and_crops():
    g = torch.Generator().manual_seed(0)
    ref, grown = DynamicCache(), GrowingCache()
    layers = 3

    def update(k: torch.Tensor, v: torch.Tensor) -> None:
        for layer in range(layers):
            out_ref = ref.update(k + layer, v - layer, layer)
            out_grown = grown.update(k + layer, v - layer, layer)
            assert torch.equal(out_ref[0], out_grown[0]) and torch.equal(out_ref[1], out_grown[1])

    update(*_states(g, 2, 5))  # two prompts' prefill
    for cache in (ref, grown):
        cache.batch_select_indices(torch.tensor([0, 0, 0, 1, 1, 1]))  # three rows per prompt
    _same(ref, grown)
    rows = 6
    for step in range(2 * RESERVE + 7):  # past the first reserve, twice
        update(*_states(g, rows, 1 if step % 5 else 3))  # every fifth step a forward of 3 tokens (drafts)
        if step == 40:
            for cache in (ref, grown):
                cache.batch_select_indices(torch.tensor([0, 2, 3, 5]))  # finished rows dropped
            rows = 4
        if step == 90:
            for cache in (ref, grown):
                cache.crop(-2)
    _same(ref, grown)
    layer = grown.layers[0]
    assert layer.keys.data_ptr() == layer._key_buffer.data_ptr()  # still appending in place


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(50, 1024)).eval().requires_grad_(False)


@pytest.mark.parametrize("lookup", [0, 2])
def test_a_seeded_decode_gives_the_same_tokens_with_either_cache(model, lookup, monkeypatch):
    import elm_memory.backends.growing_cache as growing_cache

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()

    def run() -> list:
        return sample(
            model,
            mask,
            DecodeOptions(150, temperature=1.0, n=3, lookup_draft_tokens=lookup),
            input_ids=ids,
            eos_ids=[],
            generators=[torch.Generator().manual_seed(s) for s in (1, 2)],
            should_stop=lambda row, tokens, token: token == 3 and row % 2 == 0,  # some rows end early, dropped
        )

    grown = run()
    monkeypatch.setattr(growing_cache, "GrowingCache", DynamicCache)
    assert run() == grown
    assert len({len(tokens) for tokens, _ in grown}) > 1  # rows ended at different steps
