"""``verifier.name`` -> verifier class (plugins: the entry-point group ``elm_memory.verifiers``).

A verifier class is built by its ``from_config(cfg, backend)`` when it has one, else called with
``(cfg, backend)`` (see :func:`elm_memory.verifiers.base.build_verifier`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from elm_memory.plugins import Registry

if TYPE_CHECKING:
    from elm_memory.verifiers.base import Verifier

verifiers: Registry[Callable[..., Verifier]] = Registry("verifier", "elm_memory.verifiers")
verifiers.register("prm", "elm_memory.verifiers.prm:PRMVerifier")
verifiers.register("self_certainty", "elm_memory.verifiers.self_certainty:SelfCertaintyVerifier")
verifiers.register("logprob", "elm_memory.verifiers.logprob:LogprobVerifier")
verifiers.register("consistency", "elm_memory.verifiers.consistency:ConsistencyVerifier")
