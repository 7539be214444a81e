"""The one ELM instance of a serving process, built on first use from the environment.

LangGraph Server imports every graph at start-up and sends only JSON with a run, so the
model, store, verifier and learner are built here, once per process, and bound to the
graphs; requests choose only what :class:`~elm_memory.graph.ELMRunContext` allows.

- ``ELM_CONFIG``: a YAML config file (optional)
- ``ELM_PRESET``: a preset name (default ``cpu-demo``)
- ``ELM_<SECTION>__<KEY>``: any config field, e.g. ``ELM_VERIFIER__NAME=logprob`` (optional; see
  :mod:`elm_memory.config.env_settings`); ``ELM_SET`` (``section.key=value;...``) is deprecated
- ``ELM_AGENT_MODEL``: the math agent's chat model, ``provider:MODEL`` or ``package.module:factory``
  (see :func:`chat_model_from_env`; ``elm_memory.graphs.serving:served_chat_model``: the served model itself)
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any

from elm_memory.errors import ConfigError

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM
    from elm_memory.graph.services import ELMServices

# LangGraph Server imports a graph module once per process and passes only JSON with a run, so the
# process's one ELM lives here; it is built under the lock and never replaced.
_lock = threading.Lock()
_elm: ELM | None = None


def served_elm() -> ELM:
    """The process's ELM, built on the first call (thread-safe)."""
    global _elm
    with _lock:
        if _elm is None:
            from elm_memory.config.env_settings import config_from_env
            from elm_memory.elm import ELM

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            _elm = ELM(config_from_env(default_preset="cpu-demo"))
        return _elm


def served_services() -> ELMServices:
    return served_elm().services()


def served_config() -> ELMConfig:
    """The process's config (cheap: the model, store and learner are built by :func:`served_services`)."""
    return served_elm().config


def served_chat_model() -> Any:
    """Factory for ``ELM_AGENT_MODEL=elm_memory.graphs.serving:served_chat_model``: the math agent's chat
    model is the served ELM's own model (:class:`~elm_memory.integrations.chat_model.ElmChatModel`, in
    process, offline), loaded on the agent's first turn."""
    from elm_memory.integrations.chat_model import ElmChatModel

    return ElmChatModel(backend=lambda: served_elm().backend)


def chat_model_from_env() -> Any:
    """The math agent's chat model, from ``ELM_AGENT_MODEL``:

    - ``provider:MODEL``: LangChain's ``init_chat_model`` (the provider's package must be installed),
      e.g. ``openai:MODEL`` (``langchain-openai``) against ``OPENAI_BASE_URL``: the vLLM OpenAI
      server of the packaged model started with tool calling enabled (no key needed there);
    - ``package.module:factory``: a callable returning any LangChain chat model with tool calling.
    """
    spec = os.environ.get("ELM_AGENT_MODEL", "").strip()
    if not spec:
        raise ConfigError(
            "math_agent needs a tool-calling chat model: set ELM_AGENT_MODEL=openai:MODEL (with "
            "OPENAI_BASE_URL, e.g. a vLLM server), another provider:MODEL, or ELM_AGENT_MODEL=package.module:factory"
        )
    kind, _, rest = spec.partition(":")
    if "." not in kind:  # a provider (or a model name LangChain infers it from), not a module path
        from langchain.chat_models import init_chat_model

        options: dict[str, Any] = {"temperature": 0}
        if kind == "openai":  # ChatOpenAI refuses to build without a key; a local server needs none
            from pydantic import SecretStr

            options["api_key"] = SecretStr(os.environ.get("OPENAI_API_KEY", "EMPTY"))
        try:
            return init_chat_model(spec, **options)
        except ImportError as exc:  # the provider's package is missing
            raise ConfigError(f"ELM_AGENT_MODEL={spec!r}: {exc}") from exc
        except ValueError as exc:  # not a provider LangChain knows: a module's factory, as before
            if not rest:
                raise ConfigError(
                    f"ELM_AGENT_MODEL={spec!r}: expected provider:MODEL (e.g. openai:MODEL) or "
                    f"package.module:factory ({str(exc).splitlines()[0]})"
                ) from None
    if not rest:
        raise ConfigError(f"ELM_AGENT_MODEL={spec!r}: expected provider:MODEL or package.module:factory")
    try:
        factory = getattr(importlib.import_module(kind), rest)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"ELM_AGENT_MODEL={spec!r}: cannot import {rest!r} from {kind!r} ({exc})") from exc
    return factory()
