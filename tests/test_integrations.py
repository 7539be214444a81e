"""ELM inside other frameworks: LangChain Runnable/tool, a node for foreign state, a ReAct agent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.errors import ConfigError, InvalidQuestionError

pytestmark = pytest.mark.model
Q = "What is 2+3?"


@pytest.fixture()
def elm(tmp_path, tiny_loaded, tiny_backend):
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={"model": {"dtype": "float32"}, "store": {"path": str(tmp_path / "s")}, "training": {"steps": 0}},
    )
    with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend) as e:
        yield e


def test_langchain_runnable_and_tool(elm):
    from elm_memory.integrations.langchain import ElmRunnable

    runnable = ElmRunnable(elm, learn=False)
    out = runnable.invoke({"question": Q})
    assert out["route"] == "zero_shot" and isinstance(out["response"], str) and out["learn_job"] is None
    assert runnable.invoke(Q)["response"] == out["response"]  # greedy: same answer
    assert runnable.batch([Q, Q])[1]["response"] == out["response"]
    with pytest.raises(InvalidQuestionError):
        runnable.invoke({"prompt": Q})
    tool = runnable.as_tool(name="solve_math", description="Solve math")
    assert tool.name == "solve_math"


def test_elm_node_in_a_graph_with_other_state_keys(elm):
    from langgraph.graph import END, START, StateGraph

    from elm_memory.integrations.langgraph import elm_node

    class Other(TypedDict, total=False):
        user_query: str
        math_answer: str | None
        trace: dict

    g = StateGraph(Other)
    g.add_node(
        "math", elm_node(elm, question_key="user_query", answer_key="math_answer", trace_key="trace", learn=False)
    )
    g.add_edge(START, "math")
    g.add_edge("math", END)
    out = g.compile().invoke({"user_query": Q})
    assert "math_answer" in out and out["trace"]["route"] == "zero_shot"


def test_elm_tool_answers_and_follows_the_runs_namespace(tmp_path, tiny_loaded, tiny_backend):
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from elm_memory.graph import ELMRunContext
    from elm_memory.integrations.tools import create_elm_tool

    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "model": {"dtype": "float32"},
            "store": {"path": str(tmp_path / "s")},
            "training": {"steps": 0},
            "namespace_template": "user-{user_id}",
        },
    )
    with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend) as elm:
        tool = create_elm_tool(lambda: elm, include_trace=True)
        assert tool.name == "solve_math" and set(tool.args) == {"question"}  # config is injected, not asked for
        out = json.loads(tool.invoke({"question": Q}, config={"configurable": {"user_id": "cfg-user"}}))
        assert out["namespace"] == "user-cfg-user" and out["route"] == "zero_shot"

        g = StateGraph(MessagesState, context_schema=ELMRunContext)
        g.add_node("act", ToolNode([tool]))
        g.add_edge(START, "act")
        g.add_edge("act", END)
        call = AIMessage(content="", tool_calls=[{"name": "solve_math", "args": {"question": Q}, "id": "c1"}])
        msgs = g.compile().invoke({"messages": [call]}, context={"user_id": "ada"})["messages"]
        assert json.loads(msgs[-1].content)["namespace"] == "user-ada"
        assert elm.retriever.store.count("user-ada") == 1 and elm.retriever.store.count("user-cfg-user") == 1


def test_math_agent_with_a_tool_calling_chat_model(elm):
    from elm_memory.integrations.agents import build_math_agent
    from elm_memory.integrations.testing import ScriptedToolCaller
    from elm_memory.integrations.tools import create_elm_tool

    seen: list[list] = []

    class Recording(ScriptedToolCaller):
        def _generate(self, messages, *args, **kwargs):
            seen.append(list(messages))
            return super()._generate(messages, *args, **kwargs)

    agent = build_math_agent(Recording(), [create_elm_tool(elm)])
    out = agent.invoke({"messages": [HumanMessage(Q)]})
    kinds = [type(m) for m in out["messages"]]
    assert kinds == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert out["messages"][1].tool_calls[0]["name"] == "solve_math"
    tool_result = json.loads(out["messages"][2].content)
    assert out["messages"][3].content == f"The answer is {tool_result['answer']}."
    assert isinstance(seen[0][0], SystemMessage) and len(seen) == 2  # the model saw the system prompt, twice
    assert elm.retriever.store.count("default") == 1  # the tool call learned a memory


def test_math_agent_stops_a_model_that_never_stops_calling_tools(elm):
    from elm_memory.integrations.agents import build_math_agent
    from elm_memory.integrations.testing import ScriptedToolCaller
    from elm_memory.integrations.tools import create_elm_tool

    class Looping(ScriptedToolCaller):
        def _generate(self, messages, *args, **kwargs):
            return super()._generate([HumanMessage(Q)], *args, **kwargs)  # always another tool call

    used: list = []

    class Forced(ScriptedToolCaller):
        choice: str | None = None

        def bind_tools(self, tools, **kwargs):
            return super().bind_tools(tools).model_copy(update={"choice": kwargs.get("tool_choice")})

        def _generate(self, messages, *args, **kwargs):
            used.append(self.choice)
            return super()._generate(messages, *args, **kwargs)

    out = build_math_agent(Forced(), [create_elm_tool(elm, learn=False)], first_tool_choice="required").invoke(
        {"messages": [HumanMessage(Q)]}
    )
    assert used == ["required", None] and out["messages"][-1].content.startswith("The answer is")

    agent = build_math_agent(Looping(), [create_elm_tool(elm, learn=False)], max_steps=2, stop_repeated_calls=False)
    out = agent.invoke({"messages": [HumanMessage(Q)]})
    assert out["messages"][-1].content == "Stopped after 2 tool calls without a final answer."
    with pytest.raises(ConfigError, match="tool"):
        build_math_agent(Looping(), [])


def test_served_graphs_import_without_building_anything(monkeypatch):
    import importlib

    from elm_memory.graphs import serving

    monkeypatch.setattr(serving, "served_elm", lambda: (_ for _ in ()).throw(AssertionError("built at import")))
    served = importlib.import_module("elm_memory.graphs.elm_graph")
    agent = importlib.import_module("elm_memory.graphs.math_agent")
    assert set(served.graph.get_graph().nodes) >= {"retrieve", "dual_generate", "route", "verify", "respond"}
    assert set(agent.graph.get_graph().nodes) >= {"model", "tools"}  # LangGraph v1's agent (create_agent)
    spec = json.loads(Path("langgraph.json").read_text())
    assert spec["graphs"] == {
        "elm": "elm_memory.graphs.elm_graph:graph",
        "math_agent": "elm_memory.graphs.math_agent:graph",
    }
    monkeypatch.delenv("ELM_AGENT_MODEL", raising=False)
    with pytest.raises(ConfigError, match="ELM_AGENT_MODEL"):
        serving.chat_model_from_env()
    monkeypatch.setenv("ELM_AGENT_MODEL", "elm_memory.integrations.testing:scripted_tool_caller")
    assert type(serving.chat_model_from_env()).__name__ == "ScriptedToolCaller"
    monkeypatch.setenv("ELM_AGENT_MODEL", "openai:packaged-qwen")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # built only: nothing is sent
    chat = serving.chat_model_from_env()
    assert type(chat).__name__ == "ChatOpenAI" and chat.model_name == "packaged-qwen"
    monkeypatch.setenv("ELM_AGENT_MODEL", "no.such.module:factory")
    with pytest.raises(ConfigError, match="cannot import"):
        serving.chat_model_from_env()
