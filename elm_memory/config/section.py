"""The base of every config section (pydantic), so each section is strict the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

#: Registry name -> the names it knows (built-ins and installed plugins). Config imports no registry
#: (they sit in higher layers): the package root sets this when it is imported, which is before any
#: config module runs.
_registered_names: Callable[[str], list[str]] | None = None


def use_registered_names(lookup: Callable[[str], list[str]]) -> None:
    global _registered_names
    _registered_names = lookup


class ConfigSection(BaseModel):
    """Unknown keys are errors, so a typo never silently falls back to a default; assignments are
    validated as loading is."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def switch_word(value: Any) -> Any:
    """``on``/``off`` for a YAML boolean: YAML reads a bare ``off`` (in a file or ``--set x=off``) as False."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def registered_name(registry: str, value: str) -> str:
    """``value`` if the named registry knows it (built-ins and installed plugins), else a ValueError
    listing the known names: a typo fails when the config loads, not after the model has loaded."""
    if _registered_names is None:  # unreachable through ``import elm_memory``; kept for type checkers
        return value
    names = _registered_names(registry)
    if value not in names:
        raise ValueError(f"unknown {value!r}; available: {', '.join(names)}")
    return value
