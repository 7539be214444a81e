"""Use ELM inside LangGraph graphs whose state does not have ELM's shape.

Graphs that share the ``question``/``answer`` keys can add the compiled ELM graph itself
as a node (``parent.add_node("solve", elm.graph)``). Graphs with other key names wrap it
with :func:`elm_node`::

    builder.add_node("math", elm_node(elm, question_key="user_query", answer_key="math_answer"))

Either way ELM follows the parent's run: its namespace and ``learn`` come from the parent's
context (whatever its schema: ELM reads ``user_id``, ``namespace``, ``learn`` and its
``namespace_template``'s fields, and ignores the rest) and ``configurable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig

from elm_memory.graph.context import settings_of_enclosing_run


def elm_node(
    elm: Any,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    trace_key: str | None = None,
    namespace_key: str | None = None,
    learn: bool = True,
) -> Callable[[dict[str, Any], RunnableConfig], dict[str, Any]]:
    """A node function: reads ``state[question_key]``, writes ``state[answer_key]`` (and the trace).

    The namespace is ``state[namespace_key]`` when given, else the run's (its context, else the
    config's ``namespace_template`` filled from the context and configurable). ``learn=False``,
    or ``learn: false`` in the run's context, answers without learning.
    """

    def node(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        cfg = elm.config
        namespace, run_learn = settings_of_enclosing_run(
            config,
            namespace=state.get(namespace_key) if namespace_key else None,
            template=cfg.namespace_template,
            default=cfg.namespace,
        )
        result = elm.answer(state[question_key], namespace=namespace, learn=learn and run_learn is not False)
        update: dict[str, Any] = {answer_key: result.answer}
        if trace_key:
            update[trace_key] = result.to_dict()
        return update

    node.__name__ = "elm"
    return node
