"""Where the ELM graph is wired.

    START -> retrieve -> dual_generate -> route -> respond -> [learn_memory] -> END

``learn_memory`` runs after ``respond`` has produced the answer and only *submits* a job
to the learner (background mode returns at once; sync mode is the paper's strict online
protocol, where memory i exists before question i+1 is answered).
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from elm_memory.graph import nodes
from elm_memory.graph.context import ELMContext
from elm_memory.graph.state import ELMInput, ELMOutput, ELMState


def build_elm_graph(*, checkpointer: Any = None, name: str = "elm") -> Any:
    """The compiled ELM graph. Invoke with ``context=ELMContext(...)``."""
    graph = StateGraph(ELMState, context_schema=ELMContext, input_schema=ELMInput, output_schema=ELMOutput)
    graph.add_node("retrieve", nodes.retrieve)
    graph.add_node("dual_generate", nodes.dual_generate)
    graph.add_node("route", nodes.route)
    graph.add_node("respond", nodes.respond)
    graph.add_node("learn_memory", nodes.learn_memory)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "dual_generate")
    graph.add_edge("dual_generate", "route")
    graph.add_edge("route", "respond")
    graph.add_conditional_edges("respond", nodes.should_learn, {"learn_memory": "learn_memory", "__end__": END})
    graph.add_edge("learn_memory", END)
    return graph.compile(checkpointer=checkpointer, name=name)
