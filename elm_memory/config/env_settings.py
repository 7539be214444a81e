"""The ``ELM_`` environment variables a config reads wherever it loads: :meth:`ELMConfig.load
<elm_memory.config.ELMConfig.load>`, every ``elm`` command and the served graphs.

- any field as ``ELM_<SECTION>__<KEY>``, ``__`` between levels: ``ELM_VERIFIER__NAME=logprob``,
  ``ELM_LEARNER__RAY__ADDRESS=auto``, ``ELM_NAMESPACE_TEMPLATE=user-{user_id}``. A value reads as a
  ``--set`` value does (YAML: ``2``, ``null``, ``off``, ``[1, 2]``); names are not case-sensitive. A misspelt
  section or key is an error that lists the choices; other ``ELM_`` variables (``ELM_HOME``) are not settings;
- ``ELM_CONFIG``: a YAML config file, ``ELM_PRESET``: a preset name, each used where none is given
  (``--config``/``--preset``, ``path=``/``preset=``);
- ``ELM_SET`` (deprecated, goes in the next release): ``section.key=value`` overrides separated by ``;``,
  beneath the ``ELM_<SECTION>__<KEY>`` variables.

Layered as defaults < preset < config file < environment < overrides (``--set``): see
:mod:`~elm_memory.config.sources` and docs/configuration.md.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from elm_memory.config.loading import Layer, parse_overrides, parse_value, section_model
from elm_memory.config.section import unknown_choice, unknown_key
from elm_memory.errors import ConfigError

if TYPE_CHECKING:
    from elm_memory.config.elm_config import ELMConfig

PREFIX = "ELM_"
NESTING = "__"
FILE_VARIABLE = "ELM_CONFIG"
PRESET_VARIABLE = "ELM_PRESET"
LEGACY_VARIABLE = "ELM_SET"


def variable(environ: Mapping[str, str], name: str) -> str | None:
    """The value of ``name`` (``ELM_PRESET``) in ``environ``, whatever its case; empty: None."""
    for key in sorted(environ):
        if key.upper() == name and environ[key]:
            return environ[key]
    return None


def config_variables(model: type[BaseModel], environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that set ``model``'s fields (``ELM_<SECTION>__<KEY>``, ``ELM_NAMESPACE``,
    ``ELM_SET``, ``ELM_CONFIG``, ``ELM_PRESET``), misspelt ones included: what a test clears."""
    special = (FILE_VARIABLE, PRESET_VARIABLE, LEGACY_VARIABLE)
    return [name for name in environ if name.upper() in special or _field_path(model, name) is not None]


def _field_path(model: type[BaseModel], name: str) -> list[str] | None:
    """``ELM_VERIFIER__NAME`` -> ``["verifier", "name"]``; None for a variable that is no setting (``ELM_HOME``)."""
    upper = name.upper()
    if not upper.startswith(PREFIX) or upper in (FILE_VARIABLE, PRESET_VARIABLE, LEGACY_VARIABLE):
        return None
    parts = upper[len(PREFIX) :].lower().split(NESTING)
    if len(parts) == 1 and parts[0] not in model.model_fields:
        return None
    return parts


def _checked(model: type[BaseModel], parts: list[str], name: str) -> list[str]:
    """``parts`` if they name a field of ``model``, else a ConfigError listing the choices where it went wrong.
    Below a field that is not a section (a mapping, a value) validation checks the rest."""
    example = "e.g. ELM_VERIFIER__NAME=logprob"
    section: type[BaseModel] | None = model
    for i, key in enumerate(parts):
        if not key:
            raise ConfigError(f"{name}: an empty key; spell a field as ELM_<SECTION>__<KEY>, {example}")
        if section is None:
            break
        if key in getattr(section, "MOVED_KEYS", ()):  # an old spelling: loading moves it, with a warning
            return parts
        if key not in section.model_fields:
            if i == 0:
                raise ConfigError(f"{name}: {unknown_choice('config section', key, sorted(section.model_fields))}")
            raise ConfigError(f"{name}: {unknown_key('.'.join(parts[: i + 1]), list(section.model_fields))}")
        section = section_model(section.model_fields[key].annotation)
    if section is not None:
        first = next(iter(section.model_fields)).upper()
        raise ConfigError(
            f"{name} names the section {'.'.join(parts)}: set one key per variable, e.g. {name}{NESTING}{first}=..."
        )
    return parts


def _nested(path: list[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def _new_spelling(item: str) -> str:
    """``verifier.name=logprob`` -> ``ELM_VERIFIER__NAME=logprob``."""
    dotted, _, value = item.partition("=")
    return f"{PREFIX}{NESTING.join(k.strip().upper() for k in dotted.split('.'))}={value}"


def environment_layers(model: type[BaseModel], environ: Mapping[str, str]) -> list[Layer]:
    """One layer per variable that sets a field of ``model`` (module doc): ``ELM_SET`` first, then the rest by
    depth (``ELM_LEARNER__RAY__ADDRESS`` after a ``ELM_LEARNER__RAY`` mapping) and name. A bad variable is a
    one-line ConfigError naming it."""
    layers = []
    legacy = variable(environ, LEGACY_VARIABLE)
    if legacy:
        items = [p.strip() for p in legacy.split(";") if p.strip()]
        layers.append(Layer(f"environment {LEGACY_VARIABLE}", parse_overrides(items)))
        warnings.warn(
            f"{LEGACY_VARIABLE} is deprecated and goes in the next release; set each value as its own variable: "
            + " ".join(_new_spelling(item) for item in items),
            DeprecationWarning,
            stacklevel=4,
        )
    found = [(path, name) for name in environ if (path := _field_path(model, name)) is not None]
    for path, name in sorted(found, key=lambda item: (len(item[0]), item[1])):
        checked = _checked(model, path, name)
        layers.append(Layer(f"environment {name}", _nested(checked, parse_value(environ[name], name))))
    return layers


def config_from_env(*, default_preset: str | None = None) -> ELMConfig:
    """The config the environment describes (module doc), as :meth:`ELMConfig.load
    <elm_memory.config.ELMConfig.load>` reads it; ``default_preset`` where ``ELM_PRESET`` is unset."""
    from elm_memory.config.elm_config import ELMConfig

    preset = None if variable(os.environ, PRESET_VARIABLE) else default_preset
    return ELMConfig.load(preset=preset)
