"""The ELM LangGraph: retrieve -> dual_generate -> route -> [verify] -> respond -> [learn_memory].

- ``state.py``     the typed, serialisable graph state (what a checkpointer saves), with reducers
- ``context.py``   the per-run JSON settings (user id, namespace, learn) and namespace templates
- ``services.py``  the live parts (backend, retriever, verifier, learner) built once per process
- ``nodes.py``     one small method per node
- ``builder.py``   where the graph is wired
"""

from elm_memory.graph.builder import build_elm_graph
from elm_memory.graph.context import ELMRunContext
from elm_memory.graph.services import ELMServices
from elm_memory.graph.state import ELMInput, ELMOutput, ELMState

__all__ = ["ELMInput", "ELMOutput", "ELMRunContext", "ELMServices", "ELMState", "build_elm_graph"]
