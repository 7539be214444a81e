"""The ELM graph as served by ``langgraph dev`` / LangGraph Server (``elm`` in ``langgraph.json``).

Input: ``{"question": "...", "learn": true}``; context: ``{"user_id": "...", "namespace": "...",
"learn": ...}`` (see :class:`~elm_memory.graph.ELMRunContext`). The model and store are built
once per process on the first run (:mod:`elm_memory.graphs.serving`).
"""

from __future__ import annotations

from elm_memory.graph import build_elm_graph
from elm_memory.graphs.serving import served_config, served_services

# Undeclared context schema: the graph itself refuses unknown context keys by name (the server
# would drop them silently), checked against the config before the first run builds the model.
graph = build_elm_graph(served_services, name="elm", declare_context_schema=False, config=served_config)
