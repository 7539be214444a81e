"""The ELM graph as served by ``langgraph dev`` / LangGraph Server (see ``langgraph.json``).

The server cannot pass a model in a request, so this module registers a factory that
builds the ELM parts once per process from the environment:

- ``ELM_CONFIG``: a YAML config file (optional)
- ``ELM_PRESET``: a preset name (default ``cpu-demo``)

Input: ``{"question": "...", "namespace": "...", "learn": true}``.
"""

from __future__ import annotations

import os

from elm_memory.graph import build_elm_graph
from elm_memory.graph.context import set_default_context_factory


def _context_from_env():
    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = ELMConfig.load(os.environ.get("ELM_CONFIG") or None, preset=os.environ.get("ELM_PRESET", "cpu-demo"))
    return ELM(cfg).context()


set_default_context_factory(_context_from_env)
graph = build_elm_graph(name="elm")
