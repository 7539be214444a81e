"""The base of every config section (pydantic), so each section is strict the same way."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from elm_memory.errors import ConfigError


class NamedParts(Protocol):
    """What a config check needs of a registry (:class:`elm_memory.plugins.Registry` is one): what its
    parts are called and the names it knows, built-ins and installed plugins."""

    kind: str

    def names(self) -> list[str]: ...


#: Registry name (``"verifiers"``, ``"key_builders"``, ...) -> that registry. Config imports no registry
#: (they sit in higher layers): the package root sets this when it is imported, which is before any
#: config module runs.
_registries: Callable[[str], NamedParts] | None = None


def use_registries(lookup: Callable[[str], NamedParts]) -> None:
    global _registries
    _registries = lookup


class ConfigSection(BaseModel):
    """Unknown keys are errors, so a typo never silently falls back to a default; assignments are
    validated as loading is."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name: str, value: Any) -> None:
        """A rejected assignment raises :class:`ConfigError` and leaves the section as it was (pydantic keeps the new
        value when a check across fields fails after it was set)."""
        before, fields_set = dict(self.__dict__), set(self.__pydantic_fields_set__)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            self.__dict__.clear()
            self.__dict__.update(before)
            object.__setattr__(self, "__pydantic_fields_set__", fields_set)
            reasons = "; ".join(check_message(e) for e in exc.errors())
            raise ConfigError(f"{type(self).__name__}.{name} = {value!r} is refused: {reasons}") from None


def check_message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message: a check's own words (without pydantic's ``Value error,`` prefix), else
    pydantic's."""
    if error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return str(error["msg"])


def switch_word(value: Any) -> Any:
    """``on``/``off`` for a YAML boolean: YAML reads a bare ``off`` (in a file or ``--set x=off``) as False."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def unknown_choice(what: str, value: object, choices: Sequence[object]) -> str:
    """``unknown verifier 'logprobs'; choose one of: consistency, logprob, ... (did you mean 'logprob'?)``."""
    message = f"unknown {what} {value!r}; choose one of: {', '.join(str(c) for c in choices)}"
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def unknown_key(where: str, keys: Sequence[str]) -> str:
    """``unknown config key 'verifier.nmae'; choose one of: aggregate, ..., name, ... (did you mean 'name'?)``:
    the last part of ``where`` against the keys of the section it is in, as :func:`unknown_choice` does for
    a value."""
    key = where.rsplit(".", 1)[-1]
    message = f"unknown config key {where!r}; choose one of: {', '.join(sorted(keys))}"
    close = difflib.get_close_matches(key, list(keys), n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def registered_name(registry: str, value: str, *, also: Sequence[str] = ()) -> str:
    """``value`` if the named registry knows it (built-ins and installed plugins) or it is one of ``also``,
    else a ValueError listing the choices: a typo fails when the config loads, not after the model has
    loaded."""
    if _registries is None:  # unreachable through ``import elm_memory``; kept for type checkers
        return value
    parts = _registries(registry)
    choices = [*parts.names(), *also]
    if value not in choices:
        raise ValueError(unknown_choice(parts.kind, value, choices))
    return value
