"""A ReAct-style agent (reason -> act -> observe) whose math tool is ELM.

The reasoning step here is a small deterministic policy (call the tool for a question,
then report the tool's answer) so the example runs on a CPU without a tool-calling chat
model; the graph shape is the standard ReAct loop, so replacing ``reason`` with a chat
model bound to the same tool (``model.bind_tools([tool])``) is a one-node change.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode


def make_math_tool(elm_provider: Callable[[], Any]) -> StructuredTool:
    def solve_math(question: str) -> str:
        """Solve a math word problem step by step; returns JSON with the final answer and route."""
        result = elm_provider().answer(question)
        return json.dumps({"answer": result.answer, "route": result.route, "memory_id": result.memory_id})

    return StructuredTool.from_function(solve_math, name="solve_math")


def build_math_agent(elm_provider: Callable[[], Any] | None = None) -> Any:
    """Compile the agent. ``elm_provider`` returns the ELM instance to use (built lazily)."""
    if elm_provider is None:
        from elm_memory.graph.context import resolve_context

        class _Served:  # the served graph's process-wide ELM (graphs/elm_graph.py registers it)
            def answer(self, question: str) -> Any:
                from elm_memory.elm import ELM

                ctx = resolve_context(None)
                return ELM(ctx.config, backend=ctx.backend, retriever=ctx.retriever, verifier=ctx.verifier,
                           learner=ctx.learner).answer(question)  # fmt: skip

        served = _Served()
        elm_provider = lambda: served  # noqa: E731
    tool = make_math_tool(elm_provider)

    def reason(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        if isinstance(last, ToolMessage):
            answer = json.loads(last.content)["answer"]
            return {"messages": [AIMessage(content=f"The answer is {answer}.")]}
        if isinstance(last, HumanMessage):
            call = {"name": tool.name, "args": {"question": last.content}, "id": f"call_{uuid.uuid4().hex[:8]}"}
            return {"messages": [AIMessage(content="", tool_calls=[call])]}
        return {"messages": [AIMessage(content="I can only solve math questions.")]}

    def next_step(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "act" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("reason", reason)
    graph.add_node("act", ToolNode([tool]))
    graph.add_edge(START, "reason")
    graph.add_conditional_edges("reason", next_step, {"act": "act", END: END})
    graph.add_edge("act", "reason")
    return graph.compile(name="math_agent")
