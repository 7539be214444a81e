"""A ReAct-style math agent whose math tool is ELM (served as ``math_agent``).

See ``examples/math_agent.py`` for the runnable walkthrough; this module only exposes
the compiled graph for ``langgraph.json``.
"""

from __future__ import annotations

from graphs.elm_graph import _context_from_env  # noqa: F401  (registers the served default context)
from integrations.agents import build_math_agent

graph = build_math_agent()
