"""A user's module served by tests/test_langgraph_server.py: a parent graph with its own context schema that
embeds ELM's graph (configured with a stream memory), and a generation-backend plugin for the test.

SmolLM2 (the fast test model) never writes ``\\boxed{}``, so a stream memory would never get a label to learn
from; the plugin keeps the HF backend (training still runs on SmolLM2's logits) and replaces every completion
with one boxed answer. A real plugin is registered through the ``elm_memory.backends`` entry point; a served
module can register one at import, before the served ELM is built on the first run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from elm_memory.backends.base import Generation
from elm_memory.backends.hf import HFBackend
from elm_memory.backends.registry import backends
from elm_memory.graphs.elm_graph import graph as elm_graph

BOXED = "so \\boxed{5}"


class BoxedAnswers(HFBackend):
    """The HF backend whose every completion is ``BOXED``."""

    name = "boxed-answers"

    def generate(self, prompts: Sequence[Any], params: Any) -> list[list[Generation]]:
        ids = self.tokenizer(BOXED, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
        return [[Generation(BOXED, list(ids), "stop") for _ in range(params.n)] for _ in prompts]

    def generate_many(self, requests: Sequence[tuple[Sequence[Any], Any]]) -> list[list[list[Generation]]]:
        return [self.generate(prompts, params) for prompts, params in requests]


backends.register(BoxedAnswers.name, BoxedAnswers)


@dataclass
class StudyContext:
    user_id: str
    course: str = "algebra"  # the parent's own key: ELM ignores it


class StudyState(TypedDict, total=False):
    question: str
    learn: bool
    answer: str | None
    namespace: str
    stream_update: dict[str, Any] | None  # what ELM's learn step did to the user's stream memory
    warnings: list[str]  # a failed update is a warning, not an error: the test shows it
    log: list[str]


def plan(state: StudyState) -> StudyState:
    return {"log": ["planned"]}


_builder = StateGraph(StudyState, context_schema=StudyContext)
_builder.add_node("plan", plan)
_builder.add_node("solve", elm_graph)
_builder.add_edge(START, "plan")
_builder.add_edge("plan", "solve")
_builder.add_edge("solve", END)
study = _builder.compile(name="study")
