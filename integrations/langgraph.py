"""Use ELM inside LangGraph graphs whose state does not have ELM's shape.

Graphs that share the ``question``/``answer`` keys can add the compiled ELM graph itself
as a node (``parent.add_node("solve", elm.graph)``; runs may pass ``context={"user_id": ...}``).
Graphs with other key names wrap it with :func:`elm_node`::

    builder.add_node("math", elm_node(elm, question_key="user_query", answer_key="math_answer"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def elm_node(
    elm: Any,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    trace_key: str | None = None,
    namespace_key: str | None = None,
    learn: bool = True,
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A node function: reads ``state[question_key]``, writes ``state[answer_key]`` (and the trace)."""

    def node(state: dict[str, Any]) -> dict[str, Any]:
        namespace = state.get(namespace_key) if namespace_key else None
        result = elm.answer(state[question_key], namespace=namespace, learn=learn)
        update: dict[str, Any] = {answer_key: result.answer}
        if trace_key:
            update[trace_key] = result.to_dict()
        return update

    node.__name__ = "elm"
    return node
