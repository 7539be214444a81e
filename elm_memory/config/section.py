"""The base of every config section (pydantic), so each section is strict the same way."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """Unknown keys are errors, so a typo never silently falls back to a default; assignments are
    validated as loading is."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def registered_name(registry_attr: str, value: str) -> str:
    """``value`` if the named registry knows it (built-ins and installed plugins), else a ValueError
    listing the known names: a typo fails when the config loads, not after the model has loaded."""
    from elm_memory import registry

    names = getattr(registry, registry_attr).names()
    if value not in names:
        raise ValueError(f"unknown {value!r}; available: {', '.join(names)}")
    return value
