"""Graphs served by ``langgraph dev`` / LangGraph Server (see ``langgraph.json``).

Installed as ``elm_memory.graphs`` (this folder keeps the repository's layout):

- ``serving``     the process-wide ELM, built once from the environment on first use
- ``elm_graph``   the ELM graph itself (``elm``)
- ``math_agent``  a tool-calling agent whose math tool is ELM (``math_agent``)
"""
