"""What a run of the ELM graph may carry in its ``context``: small, JSON-only settings.

LangGraph Server builds the run context from the request's JSON, so nothing live (model,
store, learner) can be in it; those are :class:`~elm_memory.graph.services.ELMServices`,
built once per process and bound to the graph when it is built.

Namespaces follow LangMem's convention: the config's ``namespace_template`` (for example
``"user-{user_id}"``) is filled from the run context and the run's ``configurable``, so
one served graph keeps every user's memories apart without the client naming a namespace.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elm_memory.errors import ConfigError
from elm_memory.memory.ids import validate_namespace


class ELMRunContext(BaseModel):
    """Per-run settings (``graph.invoke(..., context={...})`` or the server's ``context``).

    Unknown keys are refused with an error naming them (library calls; LangGraph Server
    itself drops keys that are not in this schema before the graph sees them).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    user_id: str | None = Field(default=None, description="Fills `{user_id}` in the config's `namespace_template`.")
    namespace: str | None = Field(default=None, description="Memory namespace for this run (overrides the template).")
    learn: bool | None = Field(
        default=None, description="Learn a memory from the question after answering (default: yes)."
    )


def as_run_context(context: Any, *, strict: bool = True) -> ELMRunContext | None:
    """A run's context as :class:`ELMRunContext` (LangGraph coerces dicts; a parent graph may not).

    ``strict``: unknown keys are refused by name (the ELM graph's own runs). Otherwise they are
    ignored, and any object's attributes are read (a tool inside a user's graph, whose context
    schema has keys of its own).
    """
    if context is None or isinstance(context, ELMRunContext):
        return context
    if not strict and not isinstance(context, dict):
        context = getattr(context, "__dict__", {})
    if not isinstance(context, dict):
        raise ConfigError(
            f"the ELM graph's context is JSON settings (ELMRunContext or a dict), not {type(context).__name__}; "
            "live parts are bound when the graph is built: build_elm_graph(elm.services())"
        )
    fields = ELMRunContext.model_fields
    unknown = sorted(set(context) - set(fields))
    if unknown and strict:
        raise ConfigError(
            f"unknown context key(s) {', '.join(map(repr, unknown))} for the ELM graph; allowed: {', '.join(fields)}"
        )
    try:
        return ELMRunContext(**{k: v for k, v in context.items() if k in fields})
    except ValidationError as exc:  # one line, naming the field
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "context"
        raise ConfigError(f"context.{field}: {first.get('msg', exc)}") from None


def resolve_namespace(
    state_namespace: str | None,
    context: ELMRunContext | None,
    configurable: Mapping[str, Any] | None,
    *,
    template: str | None,
    default: str,
) -> str:
    """The run's namespace: the input's, else the context's, else the filled template, else the config's."""
    for explicit in (state_namespace, context.namespace if context is not None else None):
        if explicit is not None:
            return validate_namespace(explicit)
    if template:
        return validate_namespace(fill_template(template, context, configurable))
    return validate_namespace(default)


def fill_template(template: str, context: ELMRunContext | None, configurable: Mapping[str, Any] | None) -> str:
    """``template`` with each ``{name}`` taken from the run context, then the run's configurable."""
    values: dict[str, Any] = {k: v for k, v in (configurable or {}).items() if not str(k).startswith("__")}
    if context is not None:
        values.update({k: v for k, v in context.model_dump().items() if v is not None})
    names = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    for name in names:
        if not name.isidentifier():
            raise ConfigError(f"namespace_template {template!r}: use plain {{name}} fields, got {{{name}}}")
        if values.get(name) in (None, ""):
            raise ConfigError(
                f"namespace_template {template!r} needs {name!r}: pass it in the run's context "
                f"(context={{'{name}': ...}}) or configurable"
            )
    return template.format(**{name: str(values[name]) for name in names})
