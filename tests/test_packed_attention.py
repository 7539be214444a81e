"""Decode-step attention over packed query heads (elm_memory/backends/packed_attention.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from elm_memory.backends import packed_attention
from elm_memory.backends.packed_attention import PACK_KEYWORD, packed_eager, packed_sdpa


class _Module(torch.nn.Module):
    num_key_value_groups = 3


def _inputs(batch=4, heads=9, kv_heads=3, length=11, dim=16, seed=0, tokens=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=g)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    mask = torch.rand(batch, 1, tokens, length, generator=g) > 0.3
    mask[..., 0] = True  # every row attends to something
    return q, k, v, mask


def _repeated(q, k, v, mask, scaling):
    """The attention with every key/value head copied per query head (transformers' repeat_kv)."""
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2)


def _additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("tokens", [1, 4])  # a decode step; a step with 3 lookup drafts
@pytest.mark.parametrize("with_mask", [True, False])
def test_packed_heads_give_the_repeated_heads_attention(with_mask, tokens):
    q, k, v, mask = _inputs(tokens=tokens)
    mask = mask if with_mask else None
    out, weights = packed_sdpa(_Module(), q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (4, tokens, 9, 16)
    torch.testing.assert_close(out, _repeated(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 4])
def test_packed_eager_gives_the_models_eager_attention(tokens):
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    q, k, v, mask = _inputs(tokens=tokens)
    out, weights = packed_eager(_Module().eval(), q, k, v, _additive(mask), scaling=0.25)
    want, want_weights = eager_attention_forward(_Module().eval(), q, k, v, _additive(mask), scaling=0.25)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_a_head_attends_to_its_own_key_value_head():
    """Heads 0-2 read key/value head 0, heads 3-5 head 1: zeroing head 1's values zeroes only those."""
    q, k, v, _ = _inputs()
    v[:, 1] = 0
    out, _ = packed_sdpa(_Module(), q, k, v, None)
    assert out[:, 0, 3:6].abs().max() == 0
    assert out[:, 0, :3].abs().min() > 0 and out[:, 0, 6:].abs().min() > 0


@pytest.mark.parametrize(
    "change, message",
    [("a prefill", "at most 16 query tokens"), ("per-head mask", "shared by all heads")],
)
def test_shapes_it_cannot_pack_are_refused(change, message):
    q, k, v, mask = _inputs()
    if change == "a prefill":
        q = q.expand(-1, -1, 17, -1)
    else:
        mask = mask.expand(-1, 9, -1, -1)
    with pytest.raises(ValueError, match=message):
        packed_sdpa(_Module(), q, k, v, mask)


def test_only_calls_that_ask_are_packed(monkeypatch):
    """Installed as transformers' sdpa: a call without the keyword reaches the stock function as it was."""
    packed_attention.install()
    packed_attention.install()  # idempotent: never wraps itself
    entry = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert entry is packed_attention._dispatch_sdpa and packed_attention._stock_sdpa is not entry
    calls = []
    monkeypatch.setattr(packed_attention, "_stock_sdpa", lambda *a, **kw: calls.append(("stock", kw)) or "stock")
    monkeypatch.setattr(packed_attention, "packed_sdpa", lambda *a, **kw: calls.append(("packed", kw)) or "packed")
    q, k, v, mask = _inputs()
    assert entry(_Module(), q, k, v, mask, dropout=0.0, scaling=0.5) == "stock"
    assert entry(_Module(), q, k, v, mask, dropout=0.0, scaling=0.5, **{PACK_KEYWORD: True}) == "packed"
    assert calls[1][1]["scaling"] == 0.5
    prefill = q.expand(-1, -1, 17, -1)  # asked, but a prefill: stock, without the keyword
    assert entry(_Module(), prefill, k, v, None, **{PACK_KEYWORD: True}) == "stock"
    assert PACK_KEYWORD not in calls[-1][1]


def test_eager_calls_reach_the_models_own_eager_attention_unless_asked(monkeypatch):
    """The eager entry falls back to the calling model's modeling file's eager_attention_forward (what
    transformers itself falls back to), so models in the same process see no change."""
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    packed_attention.install()
    entry = ALL_ATTENTION_FUNCTIONS.get_interface("eager", None)
    assert entry is packed_attention._dispatch_eager
    module = qwen2.Qwen2Attention(qwen2.Qwen2Config(hidden_size=144, num_attention_heads=9, num_key_value_heads=3), 0)
    seen = []
    monkeypatch.setattr(qwen2, "eager_attention_forward", lambda *a, **kw: seen.append(kw) or ("model's", None))
    q, k, v, mask = _inputs()
    assert entry(module, q, k, v, _additive(mask), dropout=0.0, scaling=0.5) == ("model's", None)
    assert entry(module, q, k, v, _additive(mask), dropout=0.0, scaling=0.5, **{PACK_KEYWORD: True})[0].shape == (
        4,
        1,
        9,
        16,
    )
    assert len(seen) == 1 and PACK_KEYWORD not in seen[0]

    class Foreign(torch.nn.Module):  # a module whose file has no eager_attention_forward
        num_key_value_groups = 3

    with pytest.raises(RuntimeError, match="defines no eager_attention_forward"):
        entry(Foreign(), q, k, v, None, scaling=0.5)
