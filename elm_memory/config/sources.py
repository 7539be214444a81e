"""One rule for where a config's values come from, wherever it loads (``ELMConfig.load``, every ``elm``
command, the served graphs): defaults < preset < config file < environment < overrides (``--set``).

A later layer wins key by key (sections merge). ``ELM_PRESET`` and ``ELM_CONFIG`` choose the preset and the
file where none is given; the other ``ELM_`` settings are the environment layer
(:mod:`~elm_memory.config.env_settings`). :func:`changed_values` says which layer set each value that
differs from the defaults (``elm config show --changed``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from elm_memory.config.env_settings import FILE_VARIABLE, PRESET_VARIABLE, environment_layers, variable
from elm_memory.config.loading import Layer, deep_merge, load_preset_dict, read_yaml


def config_layers(
    model: type[BaseModel],
    path: str | os.PathLike[str] | None = None,
    *,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides_source: str = "overrides",
) -> list[Layer]:
    """The layers of a config of ``model``, lowest first: the preset, the file, the environment's variables
    (``environ``, default ``os.environ``; ``{}`` reads none), then ``overrides`` (named ``overrides_source``)."""
    environ = os.environ if environ is None else environ
    layers = []
    if preset is not None:
        layers.append(Layer(f"preset {preset}", load_preset_dict(preset)))
    elif (name := variable(environ, PRESET_VARIABLE)) is not None:
        layers.append(Layer(f"preset {name} ({PRESET_VARIABLE})", load_preset_dict(name)))
    if path is not None:
        layers.append(Layer(f"file {os.fspath(path)}", read_yaml(Path(path))))
    elif (file := variable(environ, FILE_VARIABLE)) is not None:
        layers.append(Layer(f"file {file} ({FILE_VARIABLE})", read_yaml(Path(file))))
    layers += environment_layers(model, environ)
    if overrides:
        layers.append(Layer(overrides_source, overrides))
    return layers


def merge_layers(layers: Sequence[Layer]) -> dict[str, Any]:
    """The layers' values deep-merged in order: what the config is validated from."""
    data: dict[str, Any] = {}
    for layer in layers:
        data = deep_merge(data, layer.values)
    return data


@dataclass(frozen=True)
class Change:
    """A value that differs from the defaults: ``key`` dotted (``verifier.name``), ``value`` as JSON, and the
    layer that set it (``environment ELM_VERIFIER__NAME``), or ``derived`` for a value the config works out from
    other values."""

    key: str
    value: Any
    source: str


def changed_values(config: BaseModel, layers: Sequence[Layer]) -> list[Change]:
    """The values of ``config`` (loaded from ``layers``) that differ from its class's defaults, in field order,
    each with the last layer that set it."""
    defaults = _leaves(type(config)().model_dump(mode="json"))
    changes = []
    for path, value in _leaves(config.model_dump(mode="json")).items():
        if path in defaults and defaults[path] == value:
            continue
        source = next((layer.source for layer in reversed(layers) if _sets(layer.values, path)), "derived")
        changes.append(Change(".".join(path), value, source))
    return changes


def _leaves(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{"a": {"b": 1}}`` -> ``{("a", "b"): 1}``; an empty mapping is a value of its own."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _sets(values: Any, path: tuple[str, ...]) -> bool:
    """Whether a layer's ``values`` set ``path``: the path itself, or a part of it to a value that replaces what
    is below (not a mapping, which merges)."""
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return False
        values = values[key]
        if not isinstance(values, dict):
            return True
    return True
