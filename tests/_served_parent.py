"""A user's own graphs with their own context schema, served next to the repository's graphs by
tests/test_langgraph_server.py: ELM joins each in one line, as a subgraph and as a tool of LangGraph v1's
agent, and takes its namespace from the user's context (the server's ``namespace_template``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from langchain.agents import create_agent
from langgraph.graph import END, START, StateGraph

from elm_memory.graphs.elm_graph import graph as elm_graph
from elm_memory.graphs.serving import served_elm
from elm_memory.integrations.testing import ScriptedToolCaller
from elm_memory.integrations.tools import create_elm_tool


@dataclass
class TeamContext:
    user_id: str
    llm: str = "team-model"  # the parent's own key: ELM ignores it


class ParentState(TypedDict, total=False):
    question: str
    learn: bool
    answer: str | None
    namespace: str
    log: list[str]


def plan(state: ParentState) -> ParentState:
    return {"log": ["planned"]}


_builder = StateGraph(ParentState, context_schema=TeamContext)
_builder.add_node("plan", plan)
_builder.add_node("solve", elm_graph)
_builder.add_edge(START, "plan")
_builder.add_edge("plan", "solve")
_builder.add_edge("solve", END)
parent = _builder.compile(name="parent")

parent_agent = create_agent(
    ScriptedToolCaller(), [create_elm_tool(served_elm, include_trace=True)], context_schema=TeamContext
)
