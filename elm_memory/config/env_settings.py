"""A config from the environment, read with pydantic-settings (how a served graph is configured).

- ``ELM_CONFIG``: a YAML config file; ``ELM_PRESET``: a preset name;
- any field as ``ELM_<SECTION>__<KEY>``, ``__`` between levels: ``ELM_VERIFIER__NAME=logprob``,
  ``ELM_LEARNER__RAY__ADDRESS=auto``, ``ELM_NAMESPACE_TEMPLATE=user-{user_id}``. A value reads as a
  ``--set`` value does (YAML: ``2``, ``null``, ``off``, ``[1, 2]``);
- ``ELM_SET`` (deprecated, goes in the next release): ``section.key=value`` overrides separated by ``;``.

Layered as defaults < preset < ``ELM_CONFIG`` < ``ELM_SET`` < ``ELM_<SECTION>__<KEY>``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from elm_memory.config.elm_config import ELMConfig
from elm_memory.config.loading import deep_merge, parse_overrides, parse_value
from elm_memory.config.section import unknown_choice
from elm_memory.errors import ConfigError

PREFIX = "ELM_"
NESTING = "__"


class _Sources(BaseSettings):
    """The variables that are not config fields; the fields are added from ``ELMConfig`` (below)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_nested_delimiter=NESTING, extra="ignore")

    config: str | None = None
    preset: str | None = None
    legacy_set: str | None = Field(default=None, validation_alias="ELM_SET")


def _settings_model() -> type[_Sources]:
    # one dict per section, so only what the environment sets is merged over the preset and the file
    # (whole sections with their defaults would undo them); the merged config is validated as one
    fields: dict[str, Any] = {}
    for name, field in ELMConfig.model_fields.items():
        section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        fields[name] = (dict[str, Any], Field(default_factory=dict)) if section else (str | None, None)
    return create_model("ELMEnvironment", __base__=_Sources, **fields)


def _values(data: Any, variable: str) -> Any:
    """Every string leaf read as YAML, as a ``--set`` value is."""
    if isinstance(data, dict):
        return {key: _values(value, f"{variable}{NESTING}{key.upper()}") for key, value in data.items()}
    return parse_value(data, variable) if isinstance(data, str) else data


def _check_sections() -> None:
    # pydantic-settings skips a variable that names no field: a misspelt section would be dropped
    sections = sorted(ELMConfig.model_fields)
    for variable in os.environ:
        if variable.upper().startswith(PREFIX) and NESTING in variable:
            section = variable[len(PREFIX) :].split(NESTING)[0].lower()
            if section not in sections:
                raise ConfigError(f"{variable}: {unknown_choice('config section', section, sections)}")


def _new_spelling(item: str) -> str:
    """``verifier.name=logprob`` -> ``ELM_VERIFIER__NAME=logprob``."""
    dotted, _, value = item.partition("=")
    return f"{PREFIX}{NESTING.join(k.strip().upper() for k in dotted.split('.'))}={value}"


def config_from_env(*, default_preset: str | None = None) -> ELMConfig:
    """The config the environment describes (module doc); ``default_preset`` when ``ELM_PRESET`` is unset."""
    _check_sections()
    try:
        settings = _settings_model()()
    except (SettingsError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{first}: set one key per variable, e.g. ELM_VERIFIER__NAME=logprob") from None
    overrides: dict[str, Any] = {}
    if settings.legacy_set:
        items = [p.strip() for p in settings.legacy_set.split(";") if p.strip()]
        overrides = parse_overrides(items)
        warnings.warn(
            "ELM_SET is deprecated and goes in the next release; set each value as its own variable: "
            + " ".join(_new_spelling(item) for item in items),
            DeprecationWarning,
            stacklevel=2,
        )
    given = settings.model_dump(exclude_unset=True, exclude={"config", "preset", "legacy_set"})
    overrides = deep_merge(overrides, {key: _values(value, f"{PREFIX}{key.upper()}") for key, value in given.items()})
    return ELMConfig.load(
        settings.config or None, preset=settings.preset or default_preset, overrides=overrides or None
    )
