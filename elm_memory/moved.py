"""Old module paths that keep importing for one release after a move (with a DeprecationWarning).

``import elm_memory.store.names`` returns :mod:`elm_memory.memory.ids` itself (the same module object,
so ``mock.patch`` on either name patches both). The package root installs :class:`MovedFinder` on
``sys.meta_path``; nothing in the package imports an old path (tests/test_layers.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: old dotted path -> where the module lives now
MOVED = {
    "elm_memory.memories.base": "elm_memory.memory.kinds",
    "elm_memory.memories.lora": "elm_memory.memory.lora",
    "elm_memory.memories.prefix": "elm_memory.memory.prefix",
    "elm_memory.store.names": "elm_memory.memory.ids",
    "elm_memory.store.peft_adapter": "elm_memory.memory.peft",
    "elm_memory.store.location": "elm_memory.config.location",
    "elm_memory.training.initialization": "elm_memory.memory.init",
    "elm_memory.retrieval.keys": "elm_memory.memory.keys",
    "elm_memory.eval.datasets": "elm_memory.data.datasets",
    "elm_memory.models.prompting": "elm_memory.backends.prompting",
    "elm_memory.models.teacher_forcing": "elm_memory.backends.teacher_forcing",
    "elm_memory.models.kv_prefix": "elm_memory.backends.kv_prefix",
    "elm_memory.cli_options": "elm_memory.cli.options",
    "elm_memory.cli_errors": "elm_memory.cli.errors",
    "elm_memory.store.cli": "elm_memory.cli.memories",
    "elm_memory.store.views": "elm_memory.cli.memory_views",
    "elm_memory.jobs.cli": "elm_memory.cli.learner",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes in the next release", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the real module: give it back its own
        module.__spec__ = self._spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path of :data:`MOVED` and hands back the module at its new path."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
