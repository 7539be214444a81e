"""The ELM LangGraph: retrieve -> dual_generate -> route -> respond -> learn_memory.

- ``state.py``    the typed, serialisable graph state (what a checkpointer saves)
- ``context.py``  the runtime dependencies injected per run (backend, retriever, verifier, learner)
- ``nodes.py``    one small function per node
- ``builder.py``  where the graph is wired
"""

from elm_memory.graph.builder import build_elm_graph
from elm_memory.graph.context import ELMContext
from elm_memory.graph.state import ELMInput, ELMOutput, ELMState

__all__ = ["ELMContext", "ELMInput", "ELMOutput", "ELMState", "build_elm_graph"]
