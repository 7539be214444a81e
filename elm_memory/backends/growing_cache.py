"""A transformers ``DynamicCache`` whose layers append in place, into room reserved ahead.

transformers' ``DynamicLayer`` appends a decode step's keys and values with ``torch.cat``: every step
copies the whole cache of every layer. At 64 rows and a few hundred tokens that is hundreds of MB a step
on a CPU whose bandwidth the weights already use up. These layers keep a buffer with room for
``RESERVE`` more tokens, write each step's keys into it, and hand attention a view of the filled part:
the same values, so the same logits, with a copy only when the room runs out (amortised: the room
grows with the cache) or rows are dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

#: Tokens of room a layer reserves beyond what it holds, at least (more as the cache grows).
RESERVE = 64


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends. ``keys`` / ``values`` are views of the filled part of
    ``_key_buffer`` / ``_value_buffer``, so everything that reads them (masks, lengths, crops) works
    unchanged."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        adding = key_states.shape[-2]
        keys, values = self._key_buffer, self._value_buffer
        if (
            keys is None
            or values is None
            or held == 0
            or keys.shape[-2] < held + adding
            or keys.shape[:2] != key_states.shape[:2]
            or self.keys is None
            or self.keys.data_ptr() != keys.data_ptr()  # the views were replaced (e.g. a base-class op)
        ):
            keys, values = self._reserve(key_states, value_states, held + adding)
        keys[:, :, held : held + adding] = key_states
        values[:, :, held : held + adding] = value_states
        self.keys, self.values = keys[:, :, : held + adding], values[:, :, : held + adding]
        return self.keys, self.values

    def _reserve(
        self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers with room for ``needed`` tokens and then some, holding what ``keys`` / ``values``
        hold now (their batch, which ``key_states`` shares)."""
        room = needed + max(RESERVE, needed // 2)
        held = self.get_seq_length()
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_empty((batch, heads, room, dim))
        values = value_states.new_empty((batch, heads, room, value_states.shape[-1]))
        if held and self.keys is not None and self.values is not None:
            keys[:, :, :held] = self.keys
            values[:, :, :held] = self.values
        self._key_buffer, self._value_buffer = keys, values
        return keys, values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``, with room to grow (one copy of the filled part)."""
        held = self.get_seq_length()
        if held > 0:
            kept_keys, kept_values = self.keys[indices], self.values[indices]  # type: ignore[index]
            self.keys, self.values = kept_keys, kept_values
            keys, values = self._reserve(kept_keys, kept_values, held)
            self.keys, self.values = keys[:, :, :held], values[:, :, :held]

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` (so the model treats it as one) of :class:`GrowingLayer` layers."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
