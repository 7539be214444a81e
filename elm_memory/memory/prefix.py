"""Prefix-tuning memories: per decoder layer, k key and k value vectors the prompt attends to first.

:meth:`PrefixAdapter.apply` hands back a fresh ``DynamicCache`` that already holds them, so a forward
over the prompt sees them as k earlier positions in every layer (PEFT's prefix tuning does the same
through ``past_key_values``). Keys are stored as the cache holds them: after RoPE, shape
(num_key_value_heads, k, head_dim).

Initialisation (:func:`question_prefix`; paper: "from the key-value activations of the question"): the
question's own tokens (no template; tiled from the start when shorter than k, as the soft prompt's
init) run through the frozen model once, and each layer's keys/values at the **last k positions** are
the prefix. Why the last k and not a pool: under causal attention the last positions' deeper-layer
states have read the whole question, and each is a real key/value the model produced, whereas
averaging keys of different positions mixes their RoPE phases (see retrieval/keys.py). The question
runs at positions -n..-1, so its last k keys are rotated as if they sat right before the prompt's
position 0: an untrained prefix of a question of exactly k tokens is the question as context
(``tests/test_memory_kinds.py`` checks that equality).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError
from elm_memory.memory.init import tile_to_length
from elm_memory.memory.kinds import PREFIX, AppliedMemory, digest_tensors
from elm_memory.models.logits import last_positions

if TYPE_CHECKING:
    from elm_memory.models.loading import LoadedModel, ModelInfo

_NAME = re.compile(r"prefix\.(\d{1,4})\.(key|value)")


class PrefixAdapter:
    """Per layer a key and a value tensor (num_key_value_heads, k, head_dim), float32."""

    kind = PREFIX

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        if not keys or len(keys) != len(values):
            raise MemoryFormatError("a prefix memory needs one key and one value tensor per layer")
        shape = tuple(keys[0].shape)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k.dim() != 3 or tuple(k.shape) != shape or tuple(v.shape) != shape or shape[1] < 1:
                raise MemoryFormatError(
                    f"prefix layer {layer}: key and value must both be (heads, k, head_dim) like layer 0's {shape}, "
                    f"got {tuple(k.shape)} and {tuple(v.shape)}"
                )
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise MemoryFormatError(f"prefix layer {layer} contains NaN or inf")
        self.keys = list(keys)
        self.values = list(values)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[1])

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> PrefixAdapter:
        """From stored tensors ``prefix.<layer>.key`` / ``.value``, layers 0..L-1 each complete."""
        found: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            match = _NAME.fullmatch(name)
            if match is None:
                raise MemoryFormatError(f"unexpected tensor {name[:80]!r} in a prefix memory")
            found.setdefault(int(match.group(1)), {})[match.group(2)] = t.detach().to("cpu", torch.float32)
        if sorted(found) != list(range(len(found))) or any(set(kv) != {"key", "value"} for kv in found.values()):
            raise MemoryFormatError("a prefix memory needs prefix.<l>.key and prefix.<l>.value for layers 0..L-1")
        return cls([found[i]["key"] for i in range(len(found))], [found[i]["value"] for i in range(len(found))])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            out[f"prefix.{layer}.key"], out[f"prefix.{layer}.value"] = k, v
        return out

    def parameters(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def trainable(self) -> PrefixAdapter:
        return PrefixAdapter(
            [torch.nn.Parameter(k.detach().clone()) for k in self.keys],
            [torch.nn.Parameter(v.detach().clone()) for v in self.values],
        )

    def detached(self) -> PrefixAdapter:
        return PrefixAdapter([k.detach().clone() for k in self.keys], [v.detach().clone() for v in self.values])

    def digest(self) -> str:
        return digest_tensors(self.tensors())

    def check_info(self, info: ModelInfo) -> None:
        """Layers, key/value heads and head size against the model, or :class:`IncompatibleMemoryError`."""
        heads, _, head_dim = self.keys[0].shape
        if (len(self.keys), heads, head_dim) != (info.num_layers, info.num_key_value_heads, info.head_dim):
            raise IncompatibleMemoryError(
                f"prefix memory has {len(self.keys)} layers x {heads} kv heads x {head_dim}; the model {info.name} "
                f"has {info.num_layers} x {info.num_key_value_heads} x {info.head_dim}"
            )

    @contextmanager
    def apply(self, model: Any, batch_size: int) -> Iterator[AppliedMemory]:
        """A fresh cache holding the prefix for ``batch_size`` rows (differentiable in the prefix)."""
        from transformers import DynamicCache

        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if (len(self.keys), *self.keys[0].shape[::2]) != (cfg.num_hidden_layers, heads, head_dim):
            raise IncompatibleMemoryError(
                f"prefix memory is {len(self.keys)} layers x {tuple(self.keys[0].shape)}; the model has "
                f"{cfg.num_hidden_layers} layers of {heads} kv heads x {head_dim}"
            )
        weight = model.get_input_embeddings().weight
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            k = k.to(weight.device, weight.dtype).unsqueeze(0).expand(batch_size, -1, -1, -1)
            v = v.to(weight.device, weight.dtype).unsqueeze(0).expand(batch_size, -1, -1, -1)
            cache.update(k, v, layer)
        yield AppliedMemory(cache=cache, past_length=self.num_tokens)


@torch.no_grad()
def question_prefix(loaded: LoadedModel, question_ids: Sequence[int], k: int) -> PrefixAdapter:
    """The initial prefix of a memory of a question: its last k positions' keys/values (module doc)."""
    from transformers import DynamicCache

    ids = list(question_ids) if len(question_ids) >= k else tile_to_length(question_ids, k)
    model = loaded.model
    device = model.get_input_embeddings().weight.device
    n = len(ids)
    cache = DynamicCache()
    model(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.arange(-n, 0, device=device).unsqueeze(0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last_positions(1, n, device),
    )
    layers: list[Any] = list(cache.layers)  # DynamicLayer: keys/values (1, kv_heads, n, head_dim)
    keys = [layer.keys[0, :, -k:, :].to("cpu", torch.float32).clone() for layer in layers]
    values = [layer.values[0, :, -k:, :].to("cpu", torch.float32).clone() for layer in layers]
    return PrefixAdapter(keys, values)
