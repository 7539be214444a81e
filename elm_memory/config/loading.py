"""Where a config's values come from besides the defaults: named presets (YAML files in
``elm_memory/presets``), a YAML file, the environment (:mod:`~elm_memory.config.env_settings`) and
``section.key=value`` overrides, deep-merged in that order as :class:`Layer` s
(:mod:`~elm_memory.config.sources`).

Every reading error is a one-line :class:`~elm_memory.errors.ConfigError` naming the file or the
override, since these are the user's typos, not bugs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from elm_memory.config.section import check_message, unknown_choice, unknown_key
from elm_memory.config.stream import current_spelling
from elm_memory.errors import ConfigError


@dataclass(frozen=True)
class Layer:
    """Values one source sets, nested as the config is: ``source`` says where they came from, e.g.
    ``preset cpu-tiny``, ``file my.yaml``, ``environment ELM_VERIFIER__NAME``, ``--set``."""

    source: str
    values: dict[str, Any]

    def __post_init__(self) -> None:  # a key that moved is read in its new place, with a warning naming the source
        stream = self.values.get("stream") if isinstance(self.values, dict) else None
        if isinstance(stream, dict):
            object.__setattr__(self, "values", {**self.values, "stream": current_spelling(stream, self.source)})


def available_presets() -> list[str]:
    files = resources.files("elm_memory.presets").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_preset_dict(name: str) -> dict[str, Any]:
    if name not in available_presets():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(available_presets())}")
    text = resources.files("elm_memory.presets").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    base = data.pop("extends", None)  # a preset that changes a few values of another
    return deep_merge(load_preset_dict(base), data) if base else data


def read_yaml(path: Path) -> dict[str, Any]:
    """A config file's mapping (empty file: ``{}``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # see parse_override
        raise ConfigError(f"config file {path} is not valid YAML: {exc}".splitlines()[0]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``, section by section (nested mappings merge; anything else replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def summarise_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line naming every bad key: an unknown key as such, a value outside a fixed set with the set
    (looked up on ``model``), else the field and the check's own message, without pydantic's ``Value
    error,`` prefix (a check on several fields names them itself)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            section = _model_at(model, err["loc"][:-1])
            parts.append(unknown_key(where, list(section.model_fields)) if section else f"unknown config key {where!r}")
            continue
        choices = _literal_choices(model, err["loc"]) if err["type"] == "literal_error" else None
        if choices is not None:
            message = unknown_choice(where.replace(".", " ").replace("_", " "), err["input"], choices)
        else:
            message = check_message(err)
        parts.append(f"{where}: {message}" if where else message)
    return "invalid config: " + "; ".join(parts)


def _literal_choices(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> tuple[Any, ...] | None:
    """The values a ``Literal`` field at ``loc`` (section, field) of ``model`` allows; None if it is not one."""
    section = _model_at(model, loc[:-1])
    field = section.model_fields.get(str(loc[-1])) if section and loc else None
    annotation = field.annotation if field else None
    return get_args(annotation) if get_origin(annotation) is Literal else None


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field's annotation is (``learner.ray``: ``RayLearnerConfig``); None for a value."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _model_at(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section at ``loc`` (``("learner", "ray")``) of ``model``; None where it is not a section."""
    for key in loc:
        field = model.model_fields.get(str(key)) if model else None
        model = section_model(field.annotation) if field else None
    return model


def parse_override(text: str) -> dict[str, Any]:
    """``"training.steps=2"`` -> ``{"training": {"steps": 2}}`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    value = parse_value(raw, text)
    out: dict[str, Any] = {}
    cur = out
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return out


def parse_value(raw: str, source: str) -> Any:
    """An override's value as YAML reads it (``2``, ``null``, ``off``, ``[1, 2]``); empty: None. ``source``
    (the override or the variable) names it in the error."""
    # safe_load builds no Python objects (a !!python tag is an error); a bad value is the
    # user's typo, so it is a ConfigError, as is "[[[..." nested past the recursion limit and
    # an integer past Python's 4300-digit conversion limit (a ValueError)
    try:
        return yaml.safe_load(raw) if raw else None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        shown = source if len(source) <= 80 else source[:77] + "..."
        raise ConfigError(f"override {shown!r}: the value is not valid YAML ({first})") from None


def parse_overrides(items: Iterable[str] | None) -> dict[str, Any]:
    """Several ``section.key=value`` overrides (``--set``, ``ELM_SET``) merged in order: later wins."""
    out: dict[str, Any] = {}
    for item in items or ():
        out = deep_merge(out, parse_override(item))
    return out
