"""The name -> implementation registry class, so a config string picks a class.

Each base package owns its registries and registers its built-ins where they are defined
(``elm_memory.backends.registry``, ``elm_memory.verifiers.registry``, ``elm_memory.memory.keys``,
``elm_memory.store.registry``, ``elm_memory.jobs.registry``, ``elm_memory.training.registry``,
``elm_memory.eval.methods.registry``): a built-in is an import path of its own package (nothing heavy is
imported until a name is used) or the object itself. Third parties add implementations through entry
points in the groups ``elm_memory.backends``, ``elm_memory.verifiers``, ``elm_memory.key_builders``,
``elm_memory.stores``, ``elm_memory.eval_methods``, ``elm_memory.learners`` and
``elm_memory.training_engines``::

    [project.entry-points."elm_memory.verifiers"]
    my_scorer = "my_pkg.scoring:MyVerifier"

Each registry is typed by what a name resolves to: a class or factory that builds its part's
Protocol (``GenerationBackend``, ``Verifier``, ...).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Generic, TypeVar

from elm_memory.errors import RegistryError

F = TypeVar("F")


class Registry(Generic[F]):
    """A named set of ``F`` (a class or factory): ``"module.path:Attr"`` strings or objects."""

    def __init__(self, kind: str, group: str):
        self.kind = kind
        self.group = group
        self._entries: dict[str, str | F] = {}
        self._plugins_loaded = False

    def register(self, name: str, target: str | F | None = None) -> Any:
        """``register("x", "pkg.mod:Cls")`` or as a decorator ``@register("x")``."""
        if target is not None:
            self._entries[name] = target
            return target

        def deco(obj: F) -> F:
            self._entries[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def get(self, name: str) -> F:
        self._load_plugins()
        try:
            target = self._entries[name]
        except KeyError:
            raise RegistryError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                target = getattr(importlib.import_module(module), attr)
            except ImportError as exc:
                raise RegistryError(f"{self.kind} {name!r} needs a missing dependency: {exc}") from None
            self._entries[name] = target
        return target  # an import path resolves to an F by contract (mypy takes getattr's Any on trust)

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=self.group):
            self._entries.setdefault(ep.name, ep.value)
