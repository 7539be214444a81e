"""What a run of the ELM graph may carry in its ``context``: small, JSON-only settings.

LangGraph Server builds the run context from the request's JSON, so nothing live (model,
store, learner) can be in it; those are :class:`~elm_memory.graph.services.ELMServices`,
built once per process and bound to the graph when it is built.

Namespaces follow LangMem's convention: the config's ``namespace_template`` (for example
``"user-{user_id}"``) is filled from the run context and the run's ``configurable``, so
one served graph keeps every user's memories apart without the client naming a namespace.

ELM composes: inside a user's graph (as a subgraph, a node or a tool) the run's context is
the parent's, of the parent's own schema (a dataclass, a TypedDict, a pydantic model). ELM
reads only its own keys from it (:data:`RUN_CONTEXT_KEYS` and the template's fields) and
ignores the rest; run as the graph itself, it refuses keys it does not know, so a misspelt
key fails the run instead of being dropped.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elm_memory.errors import ConfigError
from elm_memory.memory.ids import validate_namespace

# LangGraph's own convention for a task's ``configurable["checkpoint_ns"]``: ``node:task_id`` for the
# graph being run, ``parent_node:task_id|node:task_id`` one graph down (langgraph/pregel/_algo.py)
_NS_SEP = "|"


class ELMRunContext(BaseModel):
    """Per-run settings (``graph.invoke(..., context={...})`` or the server's ``context``).

    Besides the fields below, a run may carry the fields its config's ``namespace_template``
    names (e.g. ``team`` for ``"{team}-{user_id}"``). Any other key is refused with an error
    naming it when the ELM graph is the graph being run (library calls; LangGraph Server
    itself drops keys that are not in a declared schema before the graph sees them), and
    ignored when ELM runs inside another graph, whose context has keys of its own.
    """

    # extra keys are kept (a template's fields) and checked by as_run_context, which knows the template;
    # numbers become strings: a parent's `user_id: int` still fills "user-{user_id}"
    model_config = ConfigDict(extra="allow", frozen=True, coerce_numbers_to_str=True)

    user_id: str | None = Field(default=None, description="Fills `{user_id}` in the config's `namespace_template`.")
    namespace: str | None = Field(default=None, description="Memory namespace for this run (overrides the template).")
    learn: bool | None = Field(
        default=None, description="Learn a memory from the question after answering (default: yes)."
    )


RUN_CONTEXT_KEYS: tuple[str, ...] = tuple(ELMRunContext.model_fields)


def template_fields(template: str | None) -> tuple[str, ...]:
    """The ``{name}`` fields of a namespace template, in order (a malformed one is a ConfigError)."""
    if not template:
        return ()
    try:
        names = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as exc:  # an unmatched brace
        raise ConfigError(f"namespace_template {template!r}: {exc}") from None
    for name in names:
        if not name.isidentifier():
            raise ConfigError(f"namespace_template {template!r}: use plain {{name}} fields, got {{{name}}}")
    return tuple(dict.fromkeys(names))


def runs_inside_another_graph(config: RunnableConfig | None) -> bool:
    """Whether the node that has ``config`` belongs to a graph run inside another graph's node
    (a subgraph, or a graph invoked by a parent's node or tool)."""
    configurable = (config or {}).get("configurable") or {}
    return _NS_SEP in str(configurable.get("checkpoint_ns") or "")


def as_run_context(
    context: Any,
    *,
    strict: bool | None = None,
    config: RunnableConfig | None = None,
    template: str | None = None,
) -> ELMRunContext | None:
    """ELM's settings from a run's context, whatever its type: a dict or TypedDict, a dataclass, a
    pydantic model (``ELMRunContext`` or a parent's own), any object with attributes.

    ELM's keys are :data:`RUN_CONTEXT_KEYS` and the fields ``template`` names. ``strict``: a key that
    is not ELM's is refused by name; otherwise it is ignored. ``strict=None`` decides from the node's
    ``config``: strict when the ELM graph is the graph being run, lenient inside another graph.
    """
    if context is None:
        return None
    if strict is None:
        strict = not runs_inside_another_graph(config)
    own = (*RUN_CONTEXT_KEYS, *(f for f in template_fields(template) if f not in RUN_CONTEXT_KEYS))
    listed = _listed_keys(context)
    if strict:
        if listed is None:
            raise ConfigError(
                f"the ELM graph's context is a mapping, dataclass or pydantic model of its settings "
                f"({', '.join(own)}), not {type(context).__name__}"
            )
        unknown = sorted(set(listed) - set(own))
        if unknown:
            raise ConfigError(
                f"unknown context key(s) {', '.join(map(repr, unknown))} for the ELM graph; allowed: {', '.join(own)}"
            )
    values = {key: value for key in own if (value := _read(context, key)) is not None}
    try:
        return ELMRunContext(**values)
    except ValidationError as exc:  # one line, naming the field
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "context"
        raise ConfigError(f"context.{field}: {first.get('msg', exc)}") from None


def _listed_keys(context: Any) -> list[str] | None:
    """Every key a context has, where its type says (None: an object whose attributes cannot be listed)."""
    if isinstance(context, Mapping):
        return [str(k) for k in context]
    if isinstance(context, BaseModel):
        return [*type(context).model_fields, *(context.model_extra or {})]
    if dataclasses.is_dataclass(context) and not isinstance(context, type):
        return [f.name for f in dataclasses.fields(context)]
    if hasattr(context, "__dict__") and not isinstance(context, type):
        return [k for k in vars(context) if not k.startswith("_")]
    return None


def _read(context: Any, key: str) -> Any:
    return context.get(key) if isinstance(context, Mapping) else getattr(context, key, None)


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
    names = template_fields(template)
    for name in names:
        if values.get(name) in (None, ""):
            raise ConfigError(
                f"namespace_template {template!r} needs {name!r}: pass it in the run's context "
                f"(context={{'{name}': ...}}) or configurable"
            )
    return template.format(**{name: str(values[name]) for name in names})


def settings_of_enclosing_run(
    config: RunnableConfig | None, *, namespace: str | None = None, template: str | None, default: str
) -> tuple[str | None, bool | None]:
    """``(namespace, learn)`` for ELM called from inside a LangGraph run (a node, a tool, a Runnable):
    what the run's context and ``configurable`` say, read as the ELM graph reads its own. A given
    ``namespace`` wins.

    ``namespace`` is None outside a run when no template needs filling (ELM then uses its config's);
    ``learn`` is None when the context does not say.
    """
    context = as_run_context(_enclosing_run_context(), strict=False, template=template)
    learn = context.learn if context is not None else None
    if namespace is None and context is None and not template:
        return None, learn
    configurable = (config or {}).get("configurable") or {}
    return resolve_namespace(namespace, context, configurable, template=template, default=default), learn


def _enclosing_run_context() -> Any:
    """The context of the LangGraph run this code runs in, or None outside one."""
    from langgraph.runtime import get_runtime

    try:
        runtime = get_runtime()
    except RuntimeError:  # not inside a runnable's run at all
        return None
    return getattr(runtime, "context", None)  # None: a runnable's run, not a graph's
