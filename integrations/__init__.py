"""Adapters that put ELM into other frameworks (installed as ``elm_memory.integrations``).

- ``tools``: ``create_elm_tool``, a LangChain tool for any tool-calling agent
- ``agents``: ``build_math_agent``, a tool-calling agent (any LangChain chat model) with ELM as its tool
- ``langchain``: ``ElmRunnable``, a LangChain ``Runnable``
- ``langgraph``: ``elm_node``, a node for graphs whose state uses other key names
- ``langgraph_store``: ``langgraph_store(elm)``, the memory pool as a LangGraph ``BaseStore`` (browse, search, delete)
"""
