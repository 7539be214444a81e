"""Where the ELM graph is wired.

    START -> retrieve -> dual_generate -> route -> [verify] -> respond -> [learn_memory] -> END

The nodes are the per-question ones (:mod:`.nodes`) or, with ``stream.mode`` stream/both, the stream
memory's (:mod:`.stream`), on the same wiring.

``verify`` runs only when the two answers disagree, so traces and Studio show that branch
and its time. ``learn_memory`` runs after ``respond`` has produced the answer and only
*submits* a job to the learner (background mode returns at once; sync mode is the paper's
strict online protocol, where memory i exists before question i+1 is answered).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from elm_memory.config import ELMConfig
from elm_memory.graph.context import ELMRunContext
from elm_memory.graph.nodes import ELMNodes, ServicesProvider, after_respond, after_route
from elm_memory.graph.services import ELMServices
from elm_memory.graph.state import ELMInput, ELMOutput, ELMState


def build_elm_graph(
    services: ELMServices | ServicesProvider,
    *,
    checkpointer: Any = None,
    name: str = "elm",
    declare_context_schema: bool = True,
    config: ELMConfig | Callable[[], ELMConfig] | None = None,
) -> Any:
    """The compiled ELM graph, bound to ``services`` (or a callable returning them, called per
    node so a served graph can build them on first use). Runs take JSON settings as
    ``context`` (:class:`ELMRunContext`: ``user_id``, ``namespace``, ``learn``).

    ``declare_context_schema=False`` leaves the schema out of the compiled graph and has the
    first node validate the context instead: LangGraph Server silently drops context keys
    that a declared schema lacks, so a served graph could not refuse a misspelt key.

    ``config`` (or a callable returning it, cheap to call): the config the run's context is checked against
    before ``services`` is first called. A served graph builds its model on its first run; with ``config`` a
    misspelt context key fails that run at once instead of after the model is built.
    """
    nodes = ModeNodes(services, config)
    schema = ELMRunContext if declare_context_schema else None
    graph = StateGraph(ELMState, context_schema=schema, input_schema=ELMInput, output_schema=ELMOutput)
    # (state, runtime, config) nodes work at run time; langgraph's add_node overloads list only one of the two
    graph.add_node("retrieve", nodes.retrieve)  # type: ignore[call-overload]
    graph.add_node("dual_generate", nodes.dual_generate)
    graph.add_node("route", nodes.route)
    graph.add_node("verify", nodes.verify)
    graph.add_node("respond", nodes.respond)
    graph.add_node("learn_memory", nodes.learn_memory)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "dual_generate")
    graph.add_edge("dual_generate", "route")
    graph.add_conditional_edges("route", after_route, {"verify": "verify", "respond": "respond"})
    graph.add_edge("verify", "respond")
    graph.add_conditional_edges("respond", after_respond, {"learn_memory": "learn_memory", "__end__": END})
    graph.add_edge("learn_memory", END)
    return graph.compile(checkpointer=checkpointer, name=name)


class ModeNodes:
    """The nodes of ``stream.mode``, chosen per call: the services (and so the config) of a served graph are
    built on first use, after the graph is compiled."""

    def __init__(
        self, services: ELMServices | ServicesProvider, config: ELMConfig | Callable[[], ELMConfig] | None = None
    ):
        from elm_memory.graph.stream import StreamNodes

        self.per_question = ELMNodes(services, config)
        self.stream = StreamNodes(services, config)

    def _nodes(self) -> ELMNodes:
        return self.per_question if self.per_question.config.stream.mode == "per_question" else self.stream

    def retrieve(self, state: ELMState, runtime: Runtime[ELMRunContext], config: RunnableConfig) -> dict[str, Any]:
        return self._nodes().retrieve(state, runtime, config)

    def dual_generate(self, state: ELMState) -> dict[str, Any]:
        return self._nodes().dual_generate(state)

    def route(self, state: ELMState) -> dict[str, Any]:
        return self._nodes().route(state)

    def verify(self, state: ELMState) -> dict[str, Any]:
        return self._nodes().verify(state)

    def respond(self, state: ELMState) -> dict[str, Any]:
        return self._nodes().respond(state)

    def learn_memory(self, state: ELMState) -> dict[str, Any]:
        return self._nodes().learn_memory(state)
