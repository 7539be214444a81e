"""Generation after a stored KV prefix: a past computation's keys/values stand in for its tokens.

A :class:`KVPrefix` is the per-layer key/value tensors of a token sequence, computed by one
forward pass of the frozen model at positions ``0..T-1``. :func:`generate_after_prefix` loads
it into a transformers cache and feeds the new prompt at positions ``T..``, so the model sees
exactly what it would see with the prefix's tokens written before the prompt: greedy output is
the same, token for token (up to float rounding of a split prefill), without re-encoding the
prefix. Used by the LAG baseline (``elm_memory.eval.methods.lag``); transformers models only.

On disk a prefix is one safetensors file (no pickle): ``token_ids`` and ``layer.{i}.key`` /
``layer.{i}.value`` tensors of shape (kv_heads, T, head_dim), in the model's dtype, with the
model's embedding fingerprint in the metadata. Loading checks it against the model: shapes,
dtype, finiteness and the fingerprint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elm_memory.atomic import write_bytes_atomic
from elm_memory.backends.base import Generation
from elm_memory.backends.postprocess import answer_closed_after, finish_generation
from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError
from elm_memory.models.loading import ModelInfo
from elm_memory.models.logits import last_positions

_META_KEY = "elm_memory.kv_prefix"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KVPrefix:
    """The keys and values of ``token_ids`` at positions ``0..T-1``: one (kv_heads, T, head_dim) pair a layer."""

    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @classmethod
    def empty(cls) -> KVPrefix:
        return cls((), [], [])


@torch.no_grad()
def encode_prefix(model: Any, token_ids: Sequence[int]) -> KVPrefix:
    """One forward pass over ``token_ids`` (positions from 0); its per-layer keys/values, on the CPU."""
    from transformers import DynamicCache

    ids = tuple(int(t) for t in token_ids)
    if not ids:
        return KVPrefix.empty()
    device = model.get_input_embeddings().weight.device
    cache = DynamicCache()
    model(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.arange(len(ids), device=device).unsqueeze(0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last_positions(1, len(ids), device),  # only the cache is wanted
    )
    layers: list[Any] = list(cache.layers)  # attention layers: each holds (1, kv_heads, T, head_dim) keys/values
    keys = [layer.keys[0].detach().to("cpu").contiguous() for layer in layers]
    values = [layer.values[0].detach().to("cpu").contiguous() for layer in layers]
    return KVPrefix(ids, keys, values)


def save_prefix(prefix: KVPrefix, path: str | os.PathLike[str], *, fingerprint: str) -> Path:
    """Write atomically (temp file, fsync, rename): a crash leaves no half file."""
    from safetensors.torch import save

    tensors = {"token_ids": torch.tensor(prefix.token_ids, dtype=torch.long)}
    for i, (k, v) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
        tensors[f"layer.{i}.key"], tensors[f"layer.{i}.value"] = k.contiguous(), v.contiguous()
    meta = {"format": FORMAT_VERSION, "model_fingerprint": fingerprint, "layers": len(prefix.keys)}
    return write_bytes_atomic(path, save(tensors, metadata={_META_KEY: json.dumps(meta)}))


def load_prefix(path: str | os.PathLike[str], info: ModelInfo) -> KVPrefix:
    """Read a prefix file and check that it belongs to the model ``info`` describes."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_META_KEY])
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as exc:  # safetensors, json and a missing key each raise their own type on junk
        raise MemoryFormatError(f"not a KV prefix file {path}: {exc}".splitlines()[0]) from None
    if meta.get("format", 0) > FORMAT_VERSION:
        raise MemoryFormatError(f"KV prefix format {meta.get('format')} is newer than this library ({FORMAT_VERSION})")
    if meta.get("model_fingerprint") != info.fingerprint:
        raise IncompatibleMemoryError(
            f"KV prefix {path} was computed by a model with embedding fingerprint {meta.get('model_fingerprint')}; "
            f"the loaded model {info.name} has {info.fingerprint}"
        )
    ids = tensors.get("token_ids")
    if ids is None or ids.dim() != 1:
        raise MemoryFormatError(f"KV prefix {path} has no 1-D token_ids")
    want = (info.num_key_value_heads, ids.numel(), info.head_dim)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in range(info.num_layers):
        for name, into in ((f"layer.{i}.key", keys), (f"layer.{i}.value", values)):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != want or not t.is_floating_point() or not torch.isfinite(t).all():
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise MemoryFormatError(f"KV prefix {path}: {name} must be finite floats of shape {want}, got {got}")
            into.append(t)
    return KVPrefix(tuple(ids.tolist()), keys, values)


def _cache_of(prefix: KVPrefix, model: Any) -> Any:
    """A transformers cache holding the prefix (batch 1), on the model's device and in its dtype."""
    from transformers import DynamicCache

    cache = DynamicCache()
    weight = model.get_input_embeddings().weight
    for i, (k, v) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
        cache.update(k.to(weight.device, weight.dtype)[None], v.to(weight.device, weight.dtype)[None], i)
    return cache


@torch.no_grad()
def generate_after_prefix(
    model: Any,
    tokenizer: Any,
    prefix: KVPrefix,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    stop_at_answer: bool = False,
) -> Generation:
    """Greedy completion of ``prompt_ids`` placed right after ``prefix`` (positions ``T..``).

    Same stopping rules as the ``hf`` backend: an EOS ends it (left out of the completion),
    ``stop_at_answer`` ends it once a ``\\boxed{}`` answer is closed, else ``max_new_tokens``.
    The caller keeps ``T + len(prompt_ids) + max_new_tokens`` within the model's context.
    """
    if not prompt_ids:
        raise ValueError("generate_after_prefix needs at least one prompt token")
    device = model.get_input_embeddings().weight.device
    start = prefix.length
    cache = _cache_of(prefix, model)
    total = start + len(prompt_ids)
    out = model(
        input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long, device=device),
        position_ids=torch.arange(start, total, device=device).unsqueeze(0),
        attention_mask=torch.ones(1, total, dtype=torch.long, device=device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last_positions(1, len(prompt_ids), device),
    )
    eos = set(int(e) for e in eos_ids)
    closes_brace: dict[int, bool] = {}
    tokens: list[int] = []
    reason = "length"
    for step in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos:
            reason = "stop"
            break
        if stop_at_answer and answer_closed_after(tokenizer, tokens, token, closes_brace):
            reason = "answer"
            break
        if step == max_new_tokens - 1:
            break
        position = total + step
        out = model(
            input_ids=torch.tensor([[token]], dtype=torch.long, device=device),
            position_ids=torch.tensor([[position]], device=device),
            attention_mask=torch.ones(1, position + 1, dtype=torch.long, device=device),
            past_key_values=cache,
            use_cache=True,
        )
    return finish_generation(tokenizer, tokens, list(eos_ids), engine_reason=reason)
