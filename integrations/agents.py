"""A tool-calling agent (reason -> act -> observe) whose math tool is ELM, on LangGraph v1's
agent (``langchain.agents.create_agent``).

Any LangChain chat model with tool calling works, e.g. ``ChatOpenAI`` against the vLLM
OpenAI server of the packaged model::

    vllm serve PACKAGED_MODEL_DIR --enable-auto-tool-choice --tool-call-parser hermes
    model = ChatOpenAI(model=PACKAGED_MODEL_DIR, base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
    agent = build_math_agent(model, [create_elm_tool(elm)])
    agent.invoke({"messages": [("user", "Tom has 3 apples and buys 4 more. How many?")]})

Your own agent gains ELM the same way: ``create_agent(model, [create_elm_tool(elm), ...],
context_schema=YourContext)``; the tool reads its namespace from your context.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatResult
from langchain_core.tools import BaseTool

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
    stop_repeated_calls: bool = True,
    name: str = "math_agent",
    context_schema: type[Any] | None = ELMRunContext,
    checkpointer: Any = None,
) -> Any:
    """Compile the agent (``create_agent``; its nodes are ``model`` and ``tools``). ``model`` may be a
    zero-argument callable (built on the first run, once).

    ``max_steps`` bounds the reason/act loop: a model that keeps calling tools gets a final
    message saying so instead of looping until LangGraph's recursion limit. Every model turn but the
    last calls a tool, so this is also the most model turns a run takes.
    ``stop_repeated_calls``: a turn that only repeats calls the run's tools already answered (same tool,
    same arguments) ends the run with a message quoting those answers, instead of running them again (small
    models, the packaged 0.5B one included, tend to call the tool again rather than report its answer).
    ``first_tool_choice="required"`` forces a tool call on the first turn (the model still picks
    the tool and writes its arguments): small models such as the packaged 0.5B one write the
    call as plain JSON instead of their chat template's tool-call tags, which servers do not parse.
    ``context_schema``: the runs' context (yours, or ``ELMRunContext``); the ELM tool reads its keys from it.
    """
    if not tools:
        raise ConfigError("build_math_agent needs at least one tool (e.g. create_elm_tool(elm))")
    turns = MathAgentTurns(
        model, max_steps=max_steps, first_tool_choice=first_tool_choice, stop_repeated_calls=stop_repeated_calls
    )
    return create_agent(
        model if isinstance(model, BaseChatModel) else _BuiltOnFirstTurn(),
        list(tools),
        system_prompt=system_prompt,
        middleware=[turns],
        context_schema=context_schema,
        checkpointer=checkpointer,
        name=name,
    )


class MathAgentTurns(AgentMiddleware[Any, Any]):
    """The packaged agent's rules for each model turn: the chat model built on the first turn (a served
    graph imports without one), a forced tool call on the first turn where asked, a closing message
    instead of another turn once the run has made ``max_steps`` tool calls, and one instead of a turn that
    only repeats calls already answered. A run is counted from its question (the last human message), so
    a thread's earlier runs do not use up a later run's steps."""

    def __init__(
        self,
        model: BaseChatModel | Callable[[], BaseChatModel],
        *,
        max_steps: int,
        first_tool_choice: str | None,
        stop_repeated_calls: bool = False,
    ):
        super().__init__()
        self._model = model
        self._built: list[BaseChatModel] = []  # one build per process; a race builds it twice, harmlessly
        self.max_steps, self.first_tool_choice = max_steps, first_tool_choice
        self.stop_repeated_calls = stop_repeated_calls

    def chat_model(self) -> BaseChatModel:
        if not self._built:
            model = self._model
            instance = model() if not isinstance(model, BaseChatModel) and callable(model) else model
            if not hasattr(instance, "bind_tools"):
                raise ConfigError(f"{type(instance).__name__} is not a chat model with tool calling (no bind_tools)")
            self._built.append(instance)
        return self._built[0]

    def _turn(self, request: ModelRequest) -> ModelRequest | AIMessage:
        """The request to send, or the closing message when the step budget is spent."""
        steps = sum(1 for m in _this_run(request.messages) if isinstance(m, AIMessage) and m.tool_calls)
        if steps >= self.max_steps:
            return AIMessage(content=f"Stopped after {self.max_steps} tool calls without a final answer.")
        if steps == 0 and self.first_tool_choice:
            return request.override(model=self.chat_model(), tool_choice=self.first_tool_choice)
        return request.override(model=self.chat_model())

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> ModelResponse | AIMessage:
        turn = self._turn(request)
        return turn if isinstance(turn, AIMessage) else self._unrepeated(request, handler(turn))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse | AIMessage:
        turn = self._turn(request)
        return turn if isinstance(turn, AIMessage) else self._unrepeated(request, await handler(turn))

    def _unrepeated(self, request: ModelRequest, response: ModelResponse) -> ModelResponse | AIMessage:
        """``response``, or the closing message when its calls all repeat calls this run already answered."""
        reply = next((m for m in reversed(response.result) if isinstance(m, AIMessage)), None)
        if not self.stop_repeated_calls or reply is None or not reply.tool_calls:
            return response
        asked: dict[str | None, str] = {}
        answered: dict[str, str] = {}  # call (tool and arguments) -> the tool's answer
        for m in _this_run(request.messages):
            if isinstance(m, AIMessage):
                asked.update((c["id"], _call_text(c)) for c in m.tool_calls)
            elif isinstance(m, ToolMessage) and m.tool_call_id in asked:
                answered[asked[m.tool_call_id]] = m.text
        calls = [_call_text(c) for c in reply.tool_calls]
        if not all(c in answered for c in calls):
            return response
        quoted = "; ".join(f"{c} answered {answered[c]}" for c in dict.fromkeys(calls))
        return AIMessage(content=f"Stopped: the model repeated a tool call this run already answered ({quoted}).")


def _this_run(messages: Sequence[BaseMessage]) -> Sequence[BaseMessage]:
    """The messages since the run's question (the last human message)."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=-1)
    return messages[last + 1 :]


def _call_text(call: Any) -> str:
    return f"{call['name']}({json.dumps(call['args'], sort_keys=True, ensure_ascii=False)})"


class _BuiltOnFirstTurn(BaseChatModel):
    """Stands in for a chat model that :class:`MathAgentTurns` builds on the first turn and swaps in;
    ``create_agent`` wants one at compile time. Never called."""

    @property
    def _llm_type(self) -> str:
        return "built-on-first-turn"

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        raise ConfigError("the math agent's chat model is built on its first turn; this stand-in answers nothing")


def conversation(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """An agent run's messages as ``{"role", "text", "tool_calls"}`` (role ``user``, ``assistant``,
    ``tool`` or ``system``; a tool message also has ``name``), for printing or JSON."""
    roles = {"human": "user", "ai": "assistant", "tool": "tool", "system": "system"}
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": roles.get(m.type, m.type), "text": m.text}
        if isinstance(m, AIMessage):
            entry["tool_calls"] = [{"name": c["name"], "args": c["args"]} for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            entry["name"] = m.name
        out.append(entry)
    return out


def format_turn(entry: dict[str, Any]) -> str:
    """One line of :func:`conversation` for people: role, text, then the tool calls it makes."""
    role = f"tool {entry['name']}" if entry["role"] == "tool" and entry.get("name") else entry["role"]
    parts = [entry["text"].strip()] if entry["text"].strip() else []
    parts += [f"-> calls {c['name']}({json.dumps(c['args'], ensure_ascii=False)})" for c in entry.get("tool_calls", [])]
    return f"{role}: {' '.join(parts) or '(empty)'}"
