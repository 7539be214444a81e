"""``retrieval.key`` -> key builder class (plugins: the entry-point group ``elm_memory.key_builders``).

The builders themselves (:mod:`elm_memory.memory.keys`) need torch; their names do not, so a config's
``retrieval.key`` is checked when it loads without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from elm_memory.plugins import Registry

if TYPE_CHECKING:
    from elm_memory.memory.keys import KeyBuilder

key_builders: Registry[Callable[[], KeyBuilder]] = Registry("key builder", "elm_memory.key_builders")
key_builders.register("input", "elm_memory.memory.keys:InputKeyBuilder")
key_builders.register("soft_prompt_mean", "elm_memory.memory.keys:SoftPromptMeanKeyBuilder")
key_builders.register("kv", "elm_memory.memory.keys:KVKeyBuilder")
key_builders.register("kv_centered", "elm_memory.memory.keys:KVCenteredKeyBuilder")
