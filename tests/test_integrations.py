"""ELM inside other frameworks: LangChain Runnable/tool, a node for foreign state, a ReAct agent."""

from __future__ import annotations

import json
from typing import TypedDict

import pytest

from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.errors import InvalidQuestionError

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
    from integrations.langchain import ElmRunnable

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

    from integrations.langgraph import elm_node

    class Other(TypedDict, total=False):
        user_query: str
        math_answer: str | None
        trace: dict

    g = StateGraph(Other)
    g.add_node("math", elm_node(elm, question_key="user_query", answer_key="math_answer", trace_key="trace",
                                learn=False))  # fmt: skip
    g.add_edge(START, "math")
    g.add_edge("math", END)
    out = g.compile().invoke({"user_query": Q})
    assert "math_answer" in out and out["trace"]["route"] == "zero_shot"


def test_react_math_agent_calls_elm_as_its_tool(elm):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from integrations.agents import build_math_agent

    agent = build_math_agent(lambda: elm)
    out = agent.invoke({"messages": [HumanMessage(Q)]})
    kinds = [type(m) for m in out["messages"]]
    assert kinds == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert out["messages"][1].tool_calls[0]["name"] == "solve_math"
    tool_result = json.loads(out["messages"][2].content)
    assert tool_result["route"] == "zero_shot"
    assert out["messages"][3].content == f"The answer is {tool_result['answer']}."
    assert elm.retriever.store.count("default") == 1  # the tool call learned a memory


def test_served_graphs_import_and_need_no_request_objects():
    import importlib

    from elm_memory.graph.context import set_default_context_factory

    try:
        served = importlib.import_module("graphs.elm_graph")
        agent = importlib.import_module("graphs.math_agent")
        assert set(served.graph.get_graph().nodes) >= {"retrieve", "dual_generate", "route", "respond", "learn_memory"}
        assert set(agent.graph.get_graph().nodes) >= {"reason", "act"}
        spec = json.loads(open("langgraph.json").read())
        assert spec["graphs"]["elm"].endswith("graphs/elm_graph.py:graph")
    finally:
        set_default_context_factory(None)
