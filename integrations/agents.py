"""A tool-calling agent (reason -> act -> observe) whose math tool is ELM.

Any LangChain chat model with tool calling works, e.g. ``ChatOpenAI`` against the vLLM
OpenAI server of the packaged model::

    vllm serve PACKAGED_MODEL_DIR --enable-auto-tool-choice --tool-call-parser hermes
    model = ChatOpenAI(model=PACKAGED_MODEL_DIR, base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
    agent = build_math_agent(model, [create_elm_tool(elm)])
    agent.invoke({"messages": [("user", "Tom has 3 apples and buys 4 more. How many?")]})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, SystemMessage
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from elm_memory.errors import ConfigError
from elm_memory.graph.context import ELMRunContext

SYSTEM_PROMPT = (
    "You are a careful math assistant. For any math question, call the solve_math tool with the "
    "complete problem, then state its answer to the user in one sentence."
)


def build_math_agent(
    model: BaseChatModel | Callable[[], BaseChatModel],
    tools: Sequence[BaseTool],
    *,
    system_prompt: str | None = SYSTEM_PROMPT,
    max_steps: int = 6,
    first_tool_choice: str | None = None,
    name: str = "math_agent",
) -> Any:
    """Compile the agent. ``model`` may be a zero-argument callable (built on the first run, once).

    ``max_steps`` bounds the reason/act loop: a model that keeps calling tools gets a final
    message saying so instead of looping until LangGraph's recursion limit.
    ``first_tool_choice="required"`` forces a tool call on the first turn (the model still picks
    the tool and writes its arguments): small models such as the packaged 0.5B one write the
    call as plain JSON instead of their chat template's tool-call tags, which servers do not parse.
    """
    if not tools:
        raise ConfigError("build_math_agent needs at least one tool (e.g. create_elm_tool(elm))")
    bound: dict[str, Any] = {}

    def chat_model(first_turn: bool) -> Any:
        if not bound:  # one bind per process; a race builds it twice, harmlessly
            instance = model() if not isinstance(model, BaseChatModel) and callable(model) else model
            if not hasattr(instance, "bind_tools"):
                raise ConfigError(f"{type(instance).__name__} is not a chat model with tool calling (no bind_tools)")
            bound["auto"] = instance.bind_tools(list(tools))
            if first_tool_choice:
                bound["first"] = instance.bind_tools(list(tools), tool_choice=first_tool_choice)
        return bound["first"] if first_turn and "first" in bound else bound["auto"]

    def reason(state: MessagesState) -> dict[str, Any]:
        steps = sum(1 for m in state["messages"] if isinstance(m, AIMessage) and m.tool_calls)
        if steps >= max_steps:
            return {"messages": [AIMessage(content=f"Stopped after {max_steps} tool calls without a final answer.")]}
        messages = list(state["messages"])
        if system_prompt:
            messages = [SystemMessage(system_prompt), *messages]
        return {"messages": [chat_model(first_turn=steps == 0).invoke(messages)]}

    def next_step(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "act" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(MessagesState, context_schema=ELMRunContext)
    graph.add_node("reason", reason)
    graph.add_node("act", ToolNode(list(tools)))
    graph.add_edge(START, "reason")
    graph.add_conditional_edges("reason", next_step, {"act": "act", END: END})
    graph.add_edge("act", "reason")
    return graph.compile(name=name)
