"""ELM as a LangChain tool, for any tool-calling agent::

    tool = create_elm_tool(elm)                    # or create_elm_tool(lambda: elm) to build lazily
    model.bind_tools([tool])

The tool answers through the ELM graph (retrieve, dual-generate, route) and, unless
``learn=False``, learns a memory from the question. Inside a LangGraph run its namespace
follows the run like the ELM graph's own: the run context's ``namespace``, else the
config's ``namespace_template`` filled from the context (``user_id``) and configurable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool

DEFAULT_DESCRIPTION = (
    "Solve a math word problem step by step. Input: the full problem text. Returns JSON with the final answer."
)


def create_elm_tool(
    elm: Any,
    *,
    name: str = "solve_math",
    description: str = DEFAULT_DESCRIPTION,
    learn: bool = True,
    include_trace: bool = False,
) -> BaseTool:
    """A LangChain tool over ``elm`` (an ``ELM`` or a zero-argument callable returning one).

    Returns JSON: ``answer`` (and with ``include_trace``: route, memory id, similarity, namespace).
    """
    provider: Callable[[], Any] = elm if callable(elm) and not hasattr(elm, "answer") else (lambda: elm)

    def solve(question: str, config: RunnableConfig) -> str:
        instance = provider()
        result = instance.answer(question, namespace=_namespace_of_run(instance.config, config), learn=learn)
        out: dict[str, Any] = {"answer": result.answer}
        if include_trace:
            out.update(
                route=result.route, memory_id=result.memory_id, similarity=result.similarity, namespace=result.namespace
            )
        return json.dumps(out)

    solve.__doc__ = description
    return StructuredTool.from_function(solve, name=name, description=description)


def _namespace_of_run(cfg: Any, config: RunnableConfig | None) -> str | None:
    """The enclosing LangGraph run's namespace for ELM, or None (ELM's default) outside one."""
    from elm_memory.graph.context import as_run_context, resolve_namespace

    context = as_run_context(_run_context(), strict=False)
    configurable = (config or {}).get("configurable") or {}
    if context is None and not cfg.namespace_template:
        return None
    return resolve_namespace(None, context, configurable, template=cfg.namespace_template, default=cfg.namespace)


def _run_context() -> Any:
    try:
        from langgraph.runtime import get_runtime

        return get_runtime().context
    except Exception:  # not inside a LangGraph run
        return None
