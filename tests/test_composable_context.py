"""ELM inside a user's own graph: a parent with its own context schema (a dataclass, a pydantic model, a
TypedDict) runs ELM as a subgraph, as ``elm_node``, as a tool of LangGraph v1's agent and as a Runnable;
ELM reads its namespace from that context and ignores the parent's other keys, while the ELM graph run
by itself still refuses a misspelt key. Model-free: the ELM facade runs its real graph over test doubles
(a scripted backend, no store, a learner that records what it is asked to learn), in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypedDict

import pytest
from _fakes import fake_model_info
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elm_memory.backends.base import Generation
from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.errors import ConfigError

Q = "What is 2 + 3?"
TEMPLATE = "{team}-{user_id}"  # `team` is no ELMRunContext field: read from the parent's context too


class WordTokenizer:
    """One id per word; no chat template (the prompt builder then tokenizes the plain prompt)."""

    bos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [len(word) for word in text.split()]}


class BoxedFiveBackend:
    """Answers every prompt with ``\\boxed{5}``."""

    name = "scripted"

    def __init__(self) -> None:
        self.info = dataclasses.replace(fake_model_info(), max_context=4096)
        self.tokenizer = WordTokenizer()

    def generate(self, prompts: Any, params: Any) -> list[list[Generation]]:
        return [[Generation("\\boxed{5}", [1], "answer")] for _ in range(len(prompts) * params.n)]


class RecordingLearner:
    """What the graph's learn_memory node submits, as (question, namespace)."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, str]] = []

    def submit(self, question: str, namespace: str) -> Any:
        self.submitted.append((question, namespace))
        return SimpleNamespace(job_id=f"job{len(self.submitted)}", status="queued", memory_id=None)

    def close(self, wait: bool = True) -> None:
        pass


@pytest.fixture()
def elm():
    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"kind": "none"}, "namespace_template": TEMPLATE})
    with ELM(cfg, backend=BoxedFiveBackend(), verifier=SimpleNamespace(name="unused"), learner=RecordingLearner()) as e:
        yield e


# -- the parent's own context, in the three schema kinds LangGraph takes --------------------------------
@dataclass
class DataclassContext:
    user_id: str
    team: str
    llm: str = "parent-model"  # the parent's own key, which ELM must ignore


class PydanticContext(BaseModel):
    user_id: str
    team: str
    llm: str = "parent-model"


class TypedDictContext(TypedDict):
    user_id: str
    team: str
    llm: str


def _context(schema: type) -> Any:
    values = {"user_id": "ada", "team": "red", "llm": "parent-model"}
    return values if schema is TypedDictContext else schema(**values)


SCHEMAS = pytest.mark.parametrize("schema", [DataclassContext, PydanticContext, TypedDictContext])


def _learned_namespaces(elm: ELM) -> list[str]:
    return [namespace for _, namespace in elm.learner.submitted]


# -- ELM as a subgraph ----------------------------------------------------------------------------------
class ParentState(TypedDict, total=False):
    question: str
    answer: str | None
    namespace: str
    log: list[str]


@SCHEMAS
def test_elm_graph_as_a_subgraph_reads_the_parents_context(elm, schema):
    def plan(state: ParentState) -> ParentState:
        return {"log": ["planned"]}

    parent = StateGraph(ParentState, context_schema=schema)
    parent.add_node("plan", plan)
    parent.add_node("solve", elm.graph)  # the one line
    parent.add_edge(START, "plan")
    parent.add_edge("plan", "solve")
    parent.add_edge("solve", END)
    out = parent.compile().invoke({"question": Q}, context=_context(schema))
    assert out["answer"] == "5" and out["namespace"] == "red-ada" and out["log"] == ["planned"]
    assert _learned_namespaces(elm) == ["red-ada"]


# -- ELM as elm_node ------------------------------------------------------------------------------------
class ChatState(TypedDict, total=False):
    user_query: str
    math_answer: str | None
    trace: dict


@SCHEMAS
def test_elm_node_reads_the_parents_context(elm, schema):
    from elm_memory.integrations.langgraph import elm_node

    parent = StateGraph(ChatState, context_schema=schema)
    parent.add_node("math", elm_node(elm, question_key="user_query", answer_key="math_answer", trace_key="trace"))
    parent.add_edge(START, "math")
    parent.add_edge("math", END)
    out = parent.compile().invoke({"user_query": Q}, context=_context(schema))
    assert out["math_answer"] == "5" and out["trace"]["namespace"] == "red-ada"
    assert _learned_namespaces(elm) == ["red-ada"]


def test_elm_node_and_tool_take_learn_from_the_parents_context(elm):
    from elm_memory.integrations.langgraph import elm_node
    from elm_memory.integrations.tools import create_elm_tool

    @dataclass
    class Quiet:
        user_id: str = "ada"
        team: str = "red"
        learn: bool = False

    tool = create_elm_tool(elm)

    def ask_tool(state: ChatState) -> ChatState:
        return {"math_answer": json.loads(tool.invoke({"question": state["user_query"]}))["answer"]}

    for node in (elm_node(elm, question_key="user_query", answer_key="math_answer"), ask_tool):
        parent = StateGraph(ChatState, context_schema=Quiet)
        parent.add_node("math", node)
        parent.add_edge(START, "math")
        parent.add_edge("math", END)
        assert parent.compile().invoke({"user_query": Q}, context=Quiet())["math_answer"] == "5"
    assert elm.learner.submitted == []  # learn=False in the parent's context came through both


# -- ELM as a tool of LangGraph v1's agent --------------------------------------------------------------
@SCHEMAS
def test_elm_tool_in_create_agent_reads_the_agents_context(elm, schema):
    from langchain.agents import create_agent

    from elm_memory.integrations.testing import ScriptedToolCaller
    from elm_memory.integrations.tools import create_elm_tool

    agent = create_agent(ScriptedToolCaller(), [create_elm_tool(elm, include_trace=True)], context_schema=schema)
    out = agent.invoke({"messages": [HumanMessage(Q)]}, context=_context(schema))
    messages = out["messages"]
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert json.loads(messages[2].content)["namespace"] == "red-ada"
    assert messages[-1].content == "The answer is 5."
    assert _learned_namespaces(elm) == ["red-ada"]


def test_packaged_math_agent_takes_the_users_context_schema(elm):
    from elm_memory.integrations.agents import build_math_agent
    from elm_memory.integrations.testing import ScriptedToolCaller
    from elm_memory.integrations.tools import create_elm_tool

    agent = build_math_agent(ScriptedToolCaller(), [create_elm_tool(elm)], context_schema=PydanticContext)
    out = agent.invoke({"messages": [HumanMessage(Q)]}, context=_context(PydanticContext))
    assert out["messages"][-1].content == "The answer is 5." and _learned_namespaces(elm) == ["red-ada"]


# -- ELM as a Runnable ----------------------------------------------------------------------------------
def test_elm_runnable_follows_its_config_and_the_parents_context(elm):
    from elm_memory.integrations.langchain import ElmRunnable

    runnable = ElmRunnable(elm)
    out = runnable.invoke(Q, config={"configurable": {"user_id": "bob", "team": "blue"}})
    assert out["namespace"] == "blue-bob"
    assert runnable.invoke({"question": Q, "namespace": "mine"})["namespace"] == "mine"  # the input wins

    parent = StateGraph(ParentState, context_schema=DataclassContext)
    parent.add_node("solve", runnable)
    parent.add_edge(START, "solve")
    parent.add_edge("solve", END)
    parent.compile().invoke({"question": Q}, context=_context(DataclassContext))
    assert _learned_namespaces(elm) == ["blue-bob", "mine", "red-ada"]


# -- the ELM graph run by itself: its own keys only -----------------------------------------------------
def test_the_elm_graph_run_directly_refuses_a_misspelt_key_by_name(elm):
    ok = elm.graph.invoke({"question": Q}, context={"user_id": "ada", "team": "red"})  # the template's field
    assert ok["namespace"] == "red-ada"
    with pytest.raises(
        ConfigError, match=r"unknown context key\(s\) 'usr_id'.*allowed: user_id, namespace, learn, team"
    ):
        elm.graph.invoke({"question": Q}, context={"usr_id": "ada", "team": "red"})
    with pytest.raises(ConfigError, match=r"'llm'"):  # a parent's schema, run without the parent
        elm.graph.invoke({"question": Q}, context=_context(DataclassContext))
    assert _learned_namespaces(elm) == ["red-ada"]  # nothing learned for the refused runs


def test_a_served_graph_refuses_a_misspelt_key_before_its_services_are_built(elm):
    from elm_memory.graph import build_elm_graph

    built: list[int] = []

    def services():  # what a served graph's provider does on its first run: build the model
        built.append(1)
        return elm.services()

    graph = build_elm_graph(services, declare_context_schema=False, config=lambda: elm.config)
    with pytest.raises(ConfigError, match=r"unknown context key\(s\) 'usr_id'"):
        graph.invoke({"question": Q}, context={"usr_id": "ada", "team": "red"})
    assert built == []
    assert graph.invoke({"question": Q}, context={"user_id": "ada", "team": "red"})["namespace"] == "red-ada"
    assert built


# -- a repeated question ------------------------------------------------------------------------------------
def test_a_repeated_question_reports_the_memory_it_reused(tmp_path, caplog):
    from elm_memory.jobs import SyncLearner

    learned: list[str] = []

    def learn(job: Any) -> str:
        learned.append(job.question)
        return job.job_id

    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"kind": "none"}})
    learner = SyncLearner(learn, tmp_path / "learner.sqlite3")
    with ELM(cfg, backend=BoxedFiveBackend(), verifier=SimpleNamespace(name="unused"), learner=learner) as elm:
        first = elm.answer(Q, namespace="ada")
        with caplog.at_level("INFO", logger="elm_memory.jobs"):
            again = elm.answer(Q, namespace="ada")
            other = elm.answer(Q, namespace="bob")
    assert first.learn_job is not None and again.learn_job is not None and other.learn_job is not None
    assert first.learn_job["status"] == "done" and first.learn_job["reused"] is False
    assert again.learn_job["reused"] is True and again.learn_job["memory_id"] == first.learn_job["memory_id"]
    assert other.learn_job["reused"] is False  # another namespace learns its own
    assert learned == [Q, Q]
    assert [r.getMessage() for r in caplog.records if "already learned" in r.getMessage()] == [
        f"question already learned in namespace 'ada' (job {first.learn_job['job_id'][:12]}): reusing memory "
        f"{first.learn_job['memory_id'][:12]}, no new memory learned"
    ]
