"""ELM as a LangChain tool, for any tool-calling agent::

    tool = create_elm_tool(elm)                    # or create_elm_tool(lambda: elm) to build lazily
    model.bind_tools([tool])

The tool answers through the ELM graph (retrieve, dual-generate, route) and, unless
``learn=False``, learns a memory from the question. Inside a LangGraph run (any agent, any
context schema) it follows the run like the ELM graph does: the run context's ``namespace``,
else the config's ``namespace_template`` filled from the context (``user_id``, the template's
fields) and configurable; ``learn: false`` in the context turns learning off.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool

from elm_memory.graph.context import settings_of_enclosing_run

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
        cfg = instance.config
        namespace, run_learn = settings_of_enclosing_run(config, template=cfg.namespace_template, default=cfg.namespace)
        result = instance.answer(question, namespace=namespace, learn=learn and run_learn is not False)
        out: dict[str, Any] = {"answer": result.answer}
        if include_trace:
            out.update(
                route=result.route, memory_id=result.memory_id, similarity=result.similarity, namespace=result.namespace
            )
        return json.dumps(out)

    solve.__doc__ = description
    return StructuredTool.from_function(solve, name=name, description=description)
