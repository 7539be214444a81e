"""Decode-step attention that reads each key/value head once (grouped-query models).

In a grouped-query model (the default model: 14 query heads over 2 key/value heads) transformers' sdpa
attention copies every key/value head once per query head it serves (``repeat_kv``) whenever it is given
a mask and runs under ``torch.compile``: on a static cache that is the whole cache, copied seven times
per layer and step, then read again. A decode step has one query token per row, so the query heads of a
group can instead stand in for query *positions* over their shared key/value head (transformers' own
``pack_gqa``, which it applies only outside the compiler): the same attention with no copy.

The captured decode steps (:mod:`elm_memory.backends.captured`) ask for it with a keyword that reaches
the attention through the model's ``**kwargs``; every other call of the model goes to transformers' sdpa
unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

PACK_KEYWORD = "elm_pack_query_heads"  # passed to the model's forward by the callers that want packing
_install_lock = threading.Lock()
_stock: Callable[..., Any] | None = None


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
    """One query token per row: attention over each key/value head with its group's query heads as rows.

    ``query`` is (batch, query heads, 1, dim); ``key``/``value`` (batch, key/value heads, length, dim);
    ``attention_mask`` None or shared by all heads, (batch, 1, 1, length). Returns (batch, 1, query heads,
    dim), as transformers' attention functions do.
    """
    batch, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    if tokens != 1 or heads % kv_heads:
        raise ValueError(f"packed attention takes one query token per row, got query {tuple(query.shape)}")
    if attention_mask is not None and attention_mask.shape[1] != 1:
        raise ValueError(f"packed attention takes a mask shared by all heads, got {tuple(attention_mask.shape)}")
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # a group's query heads become its rows
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def _dispatch(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """transformers' ``sdpa`` entry: packed when the caller asked and the shapes allow, else the stock one."""
    wanted = kwargs.pop(PACK_KEYWORD, False)
    if (
        wanted
        and query.shape[2] == 1
        and key.shape[1] < query.shape[1]
        and (attention_mask is None or attention_mask.shape[1] == 1)
        and not args
        and not {"position_bias", "cache", "softcap"} & {k for k, v in kwargs.items() if v is not None}
    ):
        return packed_sdpa(
            module, query, key, value, attention_mask, dropout=kwargs.get("dropout", 0.0), scaling=kwargs.get("scaling")
        )
    assert _stock is not None
    return _stock(module, query, key, value, attention_mask, *args, **kwargs)


def install() -> None:
    """Route transformers' ``sdpa`` attention through :func:`_dispatch` (once per process).

    Calls without :data:`PACK_KEYWORD` reach the stock function with the same arguments, so other models
    and other paths of this model see no change.
    """
    global _stock
    from transformers.modeling_utils import AttentionInterface

    with _install_lock:
        current = AttentionInterface._global_mapping["sdpa"]
        if current is _dispatch:
            return
        _stock = current
        AttentionInterface.register("sdpa", _dispatch)
