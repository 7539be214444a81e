"""llama.cpp for decode calls of one or two rows: the model's own 4-bit GGUF read at the bytes' speed.

At one row a CPU decode step is the time it takes to read the weights. The plain loop reads the GGUF's weights
dequantized to bf16; llama.cpp reads the GGUF's 4-bit blocks themselves with kernels written for them
(docs/performance.md has the measured steps). So ``backend.one_row_engine: llama`` hands calls of at most
:data:`MAX_ROWS` rows to this engine when ``llama_cpp`` (the optional extra ``elm-memory[llama]``, a source build)
imports and the model came from a GGUF.

What it serves, like the plain loop:

- token ids, or a soft prompt as input embeddings: the whole prompt is fed as rows of the prepared model's own
  embedding table (the GGUF's table, dequantized) with the soft prompt in place;
- a LoRA memory, written once per version as a llama.cpp adapter file (:mod:`elm_memory.memory.gguf_lora`),
  loaded (llama.cpp copies it) and removed, then applied to the context; the newest few stay loaded;
- greedy and seeded sampling with the plain loop's own token choice (:mod:`elm_memory.backends.sampling`: the
  same keyed draws from the same logits would pick the same tokens; the logits differ, so tokens may too);
- EOS, the length limit and ``should_stop`` (stop at the answer), through the plain loop's own bookkeeping.

Prefix memories and per-row LoRAs are not served; :func:`unserved_reason` says why and the backend falls back.
Each row is its own sequence in one llama.cpp batch, with its own KV cells, cleared at every call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elm_memory.backends.decode import DecodeOptions, _append
from elm_memory.backends.sampling import RowChoice
from elm_memory.hardware import NOT_ASKED, ONE_ROW_MAX_ROWS
from elm_memory.memory.gguf_lora import write_gguf_lora
from elm_memory.memory.kinds import LORA
from elm_memory.memory.lora import LoraAdapter

log = logging.getLogger(__name__)

MAX_ROWS = ONE_ROW_MAX_ROWS
ADAPTERS_KEPT = 2  # the stream memory serves one version at a time; one more spares a reload when it flips back


def available() -> str | None:
    """Why llama.cpp cannot decode here (None: ``llama_cpp`` imports)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp does not import ({exc}); install the extra: pip install 'elm-memory[llama]'"
    return None


def missing(model_folder: str | Path) -> str | None:
    """Why llama.cpp cannot serve the model in ``model_folder`` here (None: it can), without reading the GGUF:
    the binding must import and the folder must have been prepared from a GGUF."""
    from elm_memory.models.prepare import MARKER

    if (why := available()) is not None:
        return why
    if not (Path(model_folder) / MARKER).is_file():
        return f"{model_folder} was not prepared from a GGUF"
    return None


def missing_for(config: Any) -> str | None:
    """:func:`missing` for an :class:`~elm_memory.config.ELMConfig`'s model, before it is loaded (``NOT_ASKED``
    when its ``backend.one_row_engine`` cannot pick llama.cpp)."""
    from elm_memory.errors import ModelNotFoundError
    from elm_memory.models.loading import resolve_model_path

    if config.backend.one_row_engine not in ("llama", "auto"):
        return NOT_ASKED
    try:
        folder = resolve_model_path(config.model.name_or_path, prepare=False)
    except ModelNotFoundError as exc:
        return str(exc)
    return missing(folder)


def unserved_reason(memory: Any) -> str | None:
    """Why this engine does not decode a call under ``memory`` (None: it does)."""
    if memory is None or (memory.kind == LORA and isinstance(memory, LoraAdapter)):
        return None
    return f"a {memory.kind} memory takes the plain loop: llama.cpp serves soft prompts and one LoRA"


class LlamaRows:
    """One llama.cpp model and context for calls of at most ``rows`` rows (see the module's docstring).

    ``adapter_dir``: where a LoRA memory's adapter file is written for the moment it takes to load it. Not
    thread-safe by itself: the backend's calls hold :attr:`lock`."""

    def __init__(
        self, gguf: Path, *, threads: int, adapter_dir: Path, rows: int = MAX_ROWS, context_per_row: int = 2048
    ):
        import llama_cpp as lc

        self.lc, self.gguf, self.threads, self.rows = lc, Path(gguf), threads, rows
        self.adapter_dir = Path(adapter_dir)
        self.lock = threading.Lock()
        lc.llama_backend_init()
        lc.llama_log_set(_quiet_callback(), ctypes.c_void_p())  # llama.cpp prints every load to stderr otherwise
        params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(self.gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_embd = lc.llama_model_n_embd(self.model)
        self.n_layer = lc.llama_model_n_layer(self.model)
        self.arch = self._meta("general.architecture")
        self.ctx: Any = None
        self._context(context_per_row)
        self.adapters: OrderedDict[str, Any] = OrderedDict()  # digest -> loaded adapter, newest last
        self.adapter_loads = 0

    # -- set-up --------------------------------------------------------------------------
    def _meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else ""

    def _context(self, per_row: int) -> None:
        """(Re)make the context and batches for ``rows`` sequences of ``per_row`` positions each."""
        lc = self.lc
        self._free_context()
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.rows * per_row
        params.n_seq_max = self.rows
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.per_row = per_row
        self.tokens = lc.llama_batch_init(params.n_ctx, 0, 1)
        self.embd = lc.llama_batch_init(params.n_ctx, self.n_embd, 1)
        self.current_adapter: str | None = None

    def _free_context(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.tokens)
            self.lc.llama_batch_free(self.embd)
            self.lc.llama_free(self.ctx)
            self.ctx = None

    def close(self) -> None:
        self._free_context()
        for adapter in self.adapters.values():
            self.lc.llama_adapter_lora_free(adapter)
        self.adapters.clear()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    # -- LoRA --------------------------------------------------------------------------------
    def use_lora(self, lora: LoraAdapter | None) -> None:
        """Apply ``lora`` to the context (None: none), writing and loading its adapter file the first time."""
        digest = None if lora is None else lora.digest()
        if digest == self.current_adapter:
            return
        if lora is None or digest is None:  # one test, both narrowed
            rc = self.lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapter = self.adapters.get(digest)
            if adapter is None:
                adapter = self._load_adapter(lora, digest)
            self.adapters.move_to_end(digest)
            adapters = (self.lc.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(1.0)  # the file's alpha / r is the LoRA's own scale
            rc = self.lc.llama_set_adapters_lora(self.ctx, adapters, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama.cpp refused the LoRA adapter (llama_set_adapters_lora returned {rc})")
        self.current_adapter = digest

    def _load_adapter(self, lora: LoraAdapter, digest: str) -> Any:
        # llama.cpp copies an adapter's tensors into its own buffers as it loads them, so the file is only a way in:
        # written, loaded and removed, a served stream memory's versions leave nothing on disk
        path = self.adapter_dir / f"lora-{digest[:24]}-{os.getpid()}-{threading.get_ident()}.gguf"
        try:
            write_gguf_lora(
                lora,
                path,
                arch=self.arch,
                n_blocks=self.n_layer,
                heads=self.lc.llama_model_n_head(self.model),
                kv_heads=self.lc.llama_model_n_head_kv(self.model),
            )
            adapter = self.lc.llama_adapter_lora_init(self.model, str(path).encode())
        finally:
            path.unlink(missing_ok=True)
        if not adapter:
            raise RuntimeError(f"llama.cpp could not load the LoRA adapter written for {digest[:12]}")
        self.adapter_loads += 1
        self.adapters[digest] = adapter
        # use_lora moves each applied adapter to the end, so the applied one is the newest but one here: with
        # ADAPTERS_KEPT >= 2 the oldest is never it
        while len(self.adapters) > ADAPTERS_KEPT:
            self.lc.llama_adapter_lora_free(self.adapters.popitem(last=False)[1])
        return adapter

    # -- decoding ----------------------------------------------------------------------------
    def sample(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        per_prompt: Sequence[DecodeOptions],
        *,
        eos_ids: Sequence[int] = (),
        generators: Sequence[torch.Generator | None] | None = None,
        should_stop: Callable[[int, list[int], int], bool] | None = None,
        lora: LoraAdapter | None = None,
    ) -> list[tuple[list[int], str]]:
        """``per_prompt[i].n`` continuations of prompt i, prompt-major, as :func:`decode.sample` returns them.
        A prompt is token ids, or a float32 (length, hidden) array of input embeddings."""
        row_prompt = [p for p, o in enumerate(per_prompt) for _ in range(o.n)]
        if len(row_prompt) > self.rows:
            raise ValueError(f"llama.cpp rows take at most {self.rows} rows a call, got {len(row_prompt)}")
        lengths = [len(prompts[p]) for p in row_prompt]
        limit = [per_prompt[p].max_new_tokens for p in row_prompt]
        need = max(n + m for n, m in zip(lengths, limit, strict=True)) + 1
        if need > self.per_row:
            self._context(max(need, 2 * self.per_row))
        self.use_lora(lora)
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        logits = self._prefill([prompts[p] for p in row_prompt])
        choice = RowChoice.of(row_prompt, list(per_prompt), generators, torch.device("cpu"))
        eos_set = set(eos_ids)
        tokens: list[list[int]] = [[] for _ in row_prompt]
        reasons = ["length"] * len(row_prompt)
        live = list(range(len(row_prompt)))
        for step in range(max(limit)):
            idx = torch.tensor(live)
            counts = torch.full((len(live),), step, dtype=torch.long)
            picked = choice.pick(
                torch.from_numpy(logits), choice.temperature[idx], choice.top_p[idx], choice.keys[idx], counts
            ).tolist()
            still = [
                row
                for row, token in zip(live, picked, strict=True)
                if _append(row, token, tokens, reasons, limit, eos_set, should_stop)
            ]
            for row in set(live) - set(still):  # a finished row's cells are not read again
                self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), row, -1, -1)
            if not still:
                break
            entries = [(lengths[row] + step, row, True) for row in still]
            fill_batch(self.tokens, entries, [tokens[row][-1] for row in still])
            logits = self._decode(self.tokens, len(still))
            live = still
        return list(zip(tokens, reasons, strict=True))

    def _prefill(self, prompts: list[Sequence[int] | np.ndarray]) -> np.ndarray:
        """Every row's prompt as sequence ``row``; the last position's logits per row."""
        entries = [(i, row, i == len(p) - 1) for row, p in enumerate(prompts) for i in range(len(p))]
        if all(not isinstance(p, np.ndarray) for p in prompts):
            fill_batch(self.tokens, entries, [int(t) for p in prompts for t in p])
            return self._decode(self.tokens, len(prompts))
        if not all(isinstance(p, np.ndarray) for p in prompts):
            raise ValueError("a call mixing token prompts and embedding prompts passes embeddings for every prompt")
        flat = np.ascontiguousarray(np.concatenate(list(prompts)), dtype=np.float32)
        if flat.shape[1] != self.n_embd:
            raise ValueError(f"input embeddings have width {flat.shape[1]}; the GGUF's is {self.n_embd}")
        ctypes.memmove(self.embd.embd, flat.ctypes.data, flat.nbytes)
        fill_batch(self.embd, entries, None)
        return self._decode(self.embd, len(prompts))

    def _decode(self, batch: Any, outputs: int) -> np.ndarray:
        rc = self.lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = self.lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(logits, shape=(outputs, self.n_vocab)).copy()


def fill_batch(batch: Any, entries: list[tuple[int, int, bool]], token_ids: list[int] | None) -> None:
    """Fill a ``llama_batch``: ``entries`` are (position, sequence, wants logits) per input, ``token_ids`` the
    tokens of a token batch (None: an embeddings batch, whose rows are copied in by the caller)."""
    for i, (pos, seq, out) in enumerate(entries):
        if token_ids is not None:
            batch.token[i] = token_ids[i]
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if out else 0
    batch.n_tokens = len(entries)


def _quiet(level: int, text: bytes, user_data: Any) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR (5 continues the line before: a progress dot)
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())


_CALLBACK: Any = None


def _quiet_callback() -> Any:
    """:func:`_quiet` as llama.cpp's log callback, made once and kept alive for the process (llama.cpp keeps
    calling it)."""
    global _CALLBACK
    if _CALLBACK is None:
        import llama_cpp as lc

        _CALLBACK = lc.llama_log_callback(_quiet)
    return _CALLBACK
