"""Adapters that put ELM into other frameworks.

- ``integrations.langchain``: ``ElmRunnable``, a LangChain ``Runnable`` (and tool via ``.as_tool()``)
- ``integrations.langgraph``: ``elm_node``, a node for graphs whose state uses other key names
- ``integrations.agents``: ``build_math_agent``, a ReAct-style agent that calls ELM as its math tool
"""
