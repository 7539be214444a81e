"""Decode-step attention that reads each key/value head once (grouped-query models).

In a grouped-query model (the default model: 14 query heads over 2 key/value heads) transformers' eager
attention, and its sdpa attention when given a mask under ``torch.compile``, copy every key/value head
once per query head it serves (``repeat_kv``): the whole KV cache, copied seven times per layer and
step, then read again. A decode step feeds one token per row (a few with lookup drafts), so the query
heads of a group can instead stand in for query *rows* over their shared key/value head (transformers'
own ``pack_gqa``, which it applies to one-token sdpa calls outside the compiler): the same attention
with no copy.

The decode loops (:mod:`elm_memory.backends.decode`, :mod:`elm_memory.backends.captured`) ask for it with
a keyword that reaches the attention through the model's ``**kwargs``. :func:`install` routes
transformers' ``sdpa`` and ``eager`` entries through this module; every call without the keyword goes to
the function it would have reached before (for ``eager``, the calling model's own
``eager_attention_forward``), with the same arguments.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

PACK_KEYWORD = "elm_pack_query_heads"  # passed to the model's forward by the callers that want packing
REQUEST = {PACK_KEYWORD: True}  # ``model(..., **REQUEST)``
MAX_PACKED_TOKENS = 16  # decode steps and lookup drafts; a prefill keeps transformers' attention
_install_lock = threading.Lock()
_stock_sdpa: Callable[..., Any] | None = None


def _unpackable(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> str | None:
    """Why these shapes cannot be packed (None: they can)."""
    heads, tokens, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    if tokens > MAX_PACKED_TOKENS or heads % kv_heads:
        return (
            f"packed attention takes at most {MAX_PACKED_TOKENS} query tokens per row and a whole number of "
            f"query heads per key/value head, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if attention_mask is not None and attention_mask.shape[1] != 1:
        return f"packed attention takes a mask shared by all heads, got {tuple(attention_mask.shape)}"
    return None


def _packed_shapes(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if (reason := _unpackable(query, key, attention_mask)) is not None:
        raise ValueError(reason)


def _pack(query: torch.Tensor, kv_heads: int, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """(batch, heads, tokens, dim) -> (batch, kv_heads, group * tokens, dim): head ``h`` serves key/value
    head ``h // group`` (transformers' ``repeat_kv`` order), its tokens become rows ``(h % group) * tokens
    + t``; the mask's rows follow (one row per token, repeated for each head of the group)."""
    batch, heads, tokens, dim = query.shape
    group = heads // kv_heads
    packed = query.reshape(batch, kv_heads, group * tokens, dim)
    if attention_mask is not None and tokens > 1:
        length = attention_mask.shape[-1]
        attention_mask = (
            attention_mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(attention_mask.shape[0], 1, -1, length)
        )
    return packed, attention_mask


def _unpack(out: torch.Tensor, heads: int, tokens: int) -> torch.Tensor:
    """(batch, kv_heads, group * tokens, dim) -> (batch, tokens, heads, dim), as attention functions return."""
    return out.reshape(out.shape[0], heads, tokens, out.shape[-1]).transpose(1, 2).contiguous()


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``scaled_dot_product_attention`` over each key/value head with its group's query heads as rows.

    ``query`` is (batch, query heads, tokens, dim) with at most :data:`MAX_PACKED_TOKENS` tokens;
    ``key``/``value`` (batch, key/value heads, length, dim); ``attention_mask`` None or shared by all heads,
    (batch, 1, tokens or 1, length). Returns (batch, tokens, query heads, dim), as transformers' do.
    """
    _packed_shapes(query, key, attention_mask)
    heads, tokens = query.shape[1], query.shape[2]
    packed, mask = _pack(query, key.shape[1], attention_mask)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return _unpack(out, heads, tokens), None


def packed_eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention (additive mask, softmax in float32) with the query heads packed as
    in :func:`packed_sdpa`. Returns the output and the attention weights, (batch, heads, tokens, length)."""
    _packed_shapes(query, key, attention_mask)
    heads, tokens = query.shape[1], query.shape[2]
    packed, mask = _pack(query, key.shape[1], attention_mask)
    weights = torch.matmul(packed, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights + mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value)
    return _unpack(out, heads, tokens), weights.reshape(weights.shape[0], heads, tokens, weights.shape[-1])


def _can_pack(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: Any) -> bool:
    return (
        bool(kwargs.pop(PACK_KEYWORD, False))
        and key.shape[1] < query.shape[1]  # grouped-query heads: something to save
        and _unpackable(query, key, attention_mask) is None
        and not {"position_bias", "cache", "softcap", "s_aux"} & {k for k, v in kwargs.items() if v is not None}
    )


def _dispatch_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """transformers' ``sdpa`` entry: packed when the caller asked and the shapes allow, else the stock one."""
    if not args and _can_pack(query, key, attention_mask, kwargs):
        return packed_sdpa(
            module, query, key, value, attention_mask, dropout=kwargs.get("dropout", 0.0), scaling=kwargs.get("scaling")
        )
    assert _stock_sdpa is not None
    return _stock_sdpa(module, query, key, value, attention_mask, *args, **kwargs)


def _model_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """The eager attention the calling model passes transformers as its default: its modeling file's."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise RuntimeError(
            f"{type(module).__module__} defines no eager_attention_forward; elm_memory's packed attention cannot "
            "tell which eager attention this model uses (load it with attn_implementation='sdpa')"
        )
    return function


def _dispatch_eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """transformers' ``eager`` entry: packed when asked and possible, else the model's own eager attention."""
    if not args and "scaling" in kwargs and _can_pack(query, key, attention_mask, kwargs):
        return packed_eager(
            module, query, key, value, attention_mask, kwargs["scaling"], dropout=kwargs.get("dropout", 0.0)
        )
    kwargs.pop(PACK_KEYWORD, None)
    return _model_eager(module)(module, query, key, value, attention_mask, *args, **kwargs)


def install() -> None:
    """Route transformers' ``sdpa`` and ``eager`` attention through this module (once per process).

    Calls without :data:`PACK_KEYWORD` reach the function they reached before with the same arguments, so
    other models and the other paths of this model see no change.
    """
    global _stock_sdpa
    from transformers.modeling_utils import AttentionInterface

    with _install_lock:
        mapping = AttentionInterface._global_mapping
        if mapping.get("sdpa") is not _dispatch_sdpa:
            _stock_sdpa = mapping["sdpa"]
            AttentionInterface.register("sdpa", _dispatch_sdpa)
        if "eager" not in mapping:  # models fall back to their own eager function when the entry is absent
            AttentionInterface.register("eager", _dispatch_eager)
