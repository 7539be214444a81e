"""Deprecated: the registries now live with the packages that own them; this module forwards to them
for one release (``from elm_memory.registry import backends`` keeps working, with a DeprecationWarning).

Nothing in the package imports it (tests/test_layers.py).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from elm_memory.plugins import Registry

_OWNER = {
    "backends": "elm_memory.backends.registry",
    "BackendFactory": "elm_memory.backends.registry",
    "verifiers": "elm_memory.verifiers.registry",
    "key_builders": "elm_memory.memory.keys",
    "stores": "elm_memory.store.registry",
    "StoreFactory": "elm_memory.store.registry",
    "eval_methods": "elm_memory.eval.methods.registry",
    "learners": "elm_memory.jobs.registry",
    "training_engines": "elm_memory.training.registry",
}
__all__ = ["Registry", *sorted(_OWNER)]


def __getattr__(name: str) -> Any:
    if name not in _OWNER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"elm_memory.registry.{name} moved to {_OWNER[name]}.{name}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_OWNER[name]), name)
