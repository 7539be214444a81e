"""A tool-calling math agent whose math tool is ELM (``math_agent`` in ``langgraph.json``).

The chat model comes from ``ELM_AGENT_MODEL`` (see :func:`~elm_memory.graphs.serving.chat_model_from_env`),
resolved on the first run; ELM is the process's served instance.
"""

from __future__ import annotations

from elm_memory.graphs.serving import chat_model_from_env, served_elm
from elm_memory.integrations.agents import build_math_agent
from elm_memory.integrations.tools import create_elm_tool

graph = build_math_agent(chat_model_from_env, [create_elm_tool(served_elm)])
