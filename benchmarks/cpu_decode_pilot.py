"""Issue #54's pilot: CPU decode engines on the packaged 0.5B model against the plain loop, in one process.

    python -m benchmarks.cpu_decode_pilot --json
    PYTHONPATH=/work/venv-llama/lib/python3.11/site-packages python -m benchmarks.cpu_decode_pilot --json

Candidates (each skipped, with the reason in the output, when it cannot run here):

- ``plain``: the ``hf`` backend's own loop (:func:`elm_memory.backends.decode.sample`) on the prepared bf16
  folder, loaded as the library loads it (prepacked weights, the resolved attention and threads);
- ``llama``: llama.cpp through ``llama-cpp-python``'s low-level API on the packaged GGUF file itself (the
  quantized bytes the wheel ships), rows as sequences of one batch, greedy by an argmax of its logits;
- ``int8``: the plain loop with every ``nn.Linear`` (lm_head included) replaced by torch's weight-only int8
  kernel (``aten._weight_int8pack_mm``, one scale per output channel), quantized from the bf16 weights;
- ``int4``: the same with ``aten._weight_int4pack_mm_for_cpu`` (4 bits, a scale and zero per 32 weights).

Every candidate decodes greedily from the same token ids, EOS ignored, so every row runs to the cap. A step's
cost is ``(t(tokens + short) - t(short)) / tokens``: prefill and per-call work cancel out. ``--rows 8`` is
eight different math questions (one sequence each), ``--rows 1`` the first. Cells alternate between the
candidates, ``--repeats`` rounds; the better round counts. The load average is recorded around each cell:
the ratios only mean something on quiet cores.

llama-cpp-python is not a dependency; it builds from source (an sdist on PyPI), e.g. into its own venv:
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-deps llama-cpp-python``, then put that venv's
site-packages on ``PYTHONPATH`` (only ``llama_cpp`` itself is imported from it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from elm_memory.backends.llama_rows import fill_batch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

QUESTIONS = [
    "What is 17 * 23 + 45?",
    "A shop sells pens at 3 dollars each. How much do 14 pens cost?",
    "What is 1234 - 567?",
    "Tom has 48 apples and gives a quarter of them away. How many are left?",
    "What is 96 / 8 + 7 * 6?",
    "A train travels 60 km per hour for 3.5 hours. How far does it go?",
    "What is the sum of the first 20 positive integers?",
    "Anna saves 15 dollars a week. How many weeks until she has 240 dollars?",
]
CANDIDATES = ("plain", "llama", "int8", "int4")


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


# -- the plain loop and the torch weight-only candidates ---------------------------------------------------


def _plain_generate(model: Any, prompts: list[list[int]], pad_id: int, new_tokens: int) -> list[list[int]]:
    from elm_memory.backends import decode

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = decode.sample(model, mask, decode.DecodeOptions(max_new_tokens=new_tokens), input_ids=ids, eos_ids=())
    return [tokens for tokens, _ in out]


class _Int8Linear(torch.nn.Module):
    """Weight-only int8: one symmetric scale per output channel; activations stay bf16."""

    def __init__(self, linear: Any):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(linear.weight.dtype)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Any) -> Any:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scale)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


class _Int4Linear(torch.nn.Module):
    """Weight-only int4 (tinygemm layout): asymmetric, a bf16 scale and zero per ``group`` input weights."""

    def __init__(self, linear: Any, group: int = 32):
        super().__init__()
        n, k = linear.weight.shape
        w = linear.weight.detach().float().reshape(n, k // group, group)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((w - lo) / scale).clamp(0, 15).reshape(n, k).to(torch.int32)
        # the kernel computes (q - 8) * scale + zero, so the zero is the value code 8 stands for
        zero = lo + 8 * scale
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.scale_zero = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1).transpose(0, 1).contiguous()
        self.scale_zero = self.scale_zero.to(linear.weight.dtype)
        self.group = group
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Any) -> Any:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, x.shape[-1]), self.packed, self.group, self.scale_zero
        )
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def _quantized_modules(model: Any, kind: str) -> dict[str, Any]:
    make = _Int8Linear if kind == "int8" else _Int4Linear
    return {name: make(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@contextlib.contextmanager
def _swapped(model: Any, modules: dict[str, Any]) -> Iterator[None]:
    """The model with ``modules`` in place of its linears, restored afterwards (one model serves all)."""
    originals = {}
    for name, new in modules.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        originals[name] = (owner, attr, getattr(owner, attr))
        setattr(owner, attr, new)
    try:
        yield
    finally:
        for owner, attr, old in originals.values():
            setattr(owner, attr, old)


# -- llama.cpp ---------------------------------------------------------------------------------------------


class LlamaEngine:
    """The GGUF in llama.cpp: rows are sequences of one batch, each with its own KV cells."""

    def __init__(self, gguf: Path, rows: int, ctx_per_row: int, threads: int):
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = rows * ctx_per_row
        cparams.n_batch = cparams.n_ubatch = rows * ctx_per_row
        cparams.n_seq_max = rows
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.settings = {
            "n_ctx": cparams.n_ctx,
            "n_seq_max": rows,
            "threads": threads,
            "flash_attn_type": int(cparams.flash_attn_type),
            "kv_unified": bool(cparams.kv_unified),
            "type_k": int(cparams.type_k),
        }
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_embd = lc.llama_model_n_embd(self.model)
        self.capacity = rows * ctx_per_row
        self.tokens = lc.llama_batch_init(self.capacity, 0, 1)
        self.embd = lc.llama_batch_init(self.capacity, self.n_embd, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.tokens)
        self.lc.llama_batch_free(self.embd)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, batch: Any, outputs: int) -> Any:
        rc = self.lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = self.lc.llama_get_logits(self.ctx)
        return self.np.ctypeslib.as_array(logits, shape=(outputs, self.n_vocab))

    def generate(self, prompts: list[list[int]], new_tokens: int, embeds: list[Any] | None = None) -> list[list[int]]:
        """Greedy, EOS ignored. ``embeds``: per row a float32 [len, n_embd] array fed instead of the
        prompt's token ids (what a soft prompt needs); positions count its rows."""
        np = self.np
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        lengths = [len(p) if embeds is None else len(e) for p, e in zip(prompts, embeds or prompts, strict=True)]
        entries = [(i, s, i == n - 1) for s, n in enumerate(lengths) for i in range(n)]
        if embeds is None:
            fill_batch(self.tokens, entries, [t for p in prompts for t in p])
            logits = self._decode(self.tokens, len(prompts))
        else:
            flat = np.ascontiguousarray(np.concatenate(embeds), dtype=np.float32)
            ctypes.memmove(self.embd.embd, flat.ctypes.data, flat.nbytes)
            fill_batch(self.embd, entries, None)
            logits = self._decode(self.embd, len(prompts))
        picked = logits.argmax(axis=1).tolist()
        out = [[t] for t in picked]
        for step in range(1, new_tokens):
            fill_batch(self.tokens, [(n + step - 1, s, True) for s, n in enumerate(lengths)], picked)
            picked = self._decode(self.tokens, len(prompts)).argmax(axis=1).tolist()
            for row, t in zip(out, picked, strict=True):
                row.append(t)
        return out


def _packaged_gguf(model: str, explicit: Path | None) -> Path:
    """The packaged model's GGUF (assembled from its pinned wheels once, then reused)."""
    from elm_memory.models.prepare import packaged_gguf

    return explicit if explicit is not None else packaged_gguf(model)


# -- timing ------------------------------------------------------------------------------------------------


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _cell(run: Callable[[int], list[list[int]]], tokens: int, short: int) -> dict[str, Any]:
    load_before = _loadavg()
    time.sleep(0.5)  # let the other engine's worker threads stop spinning
    t0 = time.perf_counter()
    run(short)
    t_short = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(short + tokens)
    t_long = time.perf_counter() - t0
    step = (t_long - t_short) / tokens
    rows = len(out)
    return {
        "ms_per_step": round(step * 1e3, 2),
        "tok_per_s": round(rows / step, 1),
        "short_call_s": round(t_short, 3),
        "long_call_s": round(t_long, 3),
        "load_before": load_before,
        "load_after": _loadavg(),
        "token_ids": out,
    }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="packaged:qwen2.5-coder-0.5b")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF for llama.cpp (default: the packaged one)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens timed per row")
    ap.add_argument("--short", type=int, default=8, help="the short call subtracted (prefill and per-call work)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="threads for every engine (0: what the library resolves)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--out", type=Path, default=None, help="also write the result here")
    return ap.parse_args()


def main() -> None:
    args = _args()

    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig
    from elm_memory.environment import collect_env
    from elm_memory.models.loading import load_model

    over: dict[str, Any] = {"name_or_path": args.model}
    if args.threads:
        over["threads"] = args.threads
    cfg = ELMConfig.load(overrides={"model": over})
    loaded = load_model(cfg.model)
    threads = torch.get_num_threads()
    tok = loaded.tokenizer
    builder = PromptBuilder(tok, cfg.prompt, loaded.info.max_context)
    prompts = [list(builder.build(q).token_ids) for q in QUESTIONS]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    row_counts = [int(r) for r in args.rows.split(",")]
    wanted = [c.strip() for c in args.candidates.split(",") if c.strip()]
    skipped: dict[str, str] = {}
    runners: dict[str, Callable[[list[list[int]], int], list[list[int]]]] = {}
    setup: dict[str, Any] = {}
    llama: LlamaEngine | None = None

    def plain(ps: list[list[int]], n: int) -> list[list[int]]:
        return _plain_generate(loaded.model, ps, pad, n)

    for name in wanted:
        if name == "plain":
            runners[name] = plain
        elif name in ("int8", "int4"):
            op = "_weight_int8pack_mm" if name == "int8" else "_weight_int4pack_mm_for_cpu"
            if not hasattr(torch.ops.aten, op):
                skipped[name] = f"this torch ({torch.__version__}) has no aten.{op}"
                continue
            t0 = time.perf_counter()
            modules = _quantized_modules(loaded.model, name)
            setup[name] = {"quantize_s": round(time.perf_counter() - t0, 1), "linears": len(modules)}

            def swapped(ps: list[list[int]], n: int, modules: dict[str, Any] = modules) -> list[list[int]]:
                with _swapped(loaded.model, modules):
                    return plain(ps, n)

            runners[name] = swapped
        elif name == "llama":
            try:
                import llama_cpp
            except ImportError as exc:
                skipped[name] = (
                    f"llama_cpp not importable ({exc}); build it with "
                    '`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-deps llama-cpp-python` '
                    "into a venv of its own and put its site-packages on PYTHONPATH"
                )
                continue
            gguf = _packaged_gguf(args.model, args.gguf)
            t0 = time.perf_counter()
            ctx_per_row = max(len(p) for p in prompts) + args.tokens + args.short + 32
            llama = LlamaEngine(gguf, max(row_counts), ctx_per_row, threads)
            setup[name] = {
                "version": getattr(llama_cpp, "__version__", None),
                "gguf": str(gguf),
                "gguf_bytes": gguf.stat().st_size,
                "load_s": round(time.perf_counter() - t0, 2),
                **llama.settings,
            }
            runners[name] = llama.generate
        else:
            skipped[name] = "unknown candidate"

    cells: list[dict[str, Any]] = []
    for round_ in range(args.repeats):
        for rows in row_counts:
            batch = prompts[:rows]
            for name, runner in runners.items():
                cell = _cell(functools.partial(runner, batch), args.tokens, args.short)
                cell.update(candidate=name, rows=rows, round=round_ + 1)
                cells.append(cell)
                if args.out is not None:  # a run cut short (shared cores, a deadline) keeps its cells
                    partial = [{k: v for k, v in c.items() if k != "token_ids"} for c in cells]
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps({"partial": True, "setup": setup, "cells": partial}, indent=2))
                print(
                    f"round {round_ + 1} rows {rows} {name}: {cell['ms_per_step']} ms/step, "
                    f"{cell['tok_per_s']} tok/s (load {cell['load_before']})",
                    file=sys.stderr,
                )

    summary: dict[str, Any] = {}
    for rows in row_counts:
        best = {
            name: min(
                (c for c in cells if c["candidate"] == name and c["rows"] == rows), key=lambda c: c["ms_per_step"]
            )
            for name in runners
        }
        entry: dict[str, Any] = {}
        for name, cell in best.items():
            entry[name] = {"ms_per_step": cell["ms_per_step"], "tok_per_s": cell["tok_per_s"]}
            if "plain" in best and name != "plain":
                ref = best["plain"]
                entry[name]["ratio_plain_over"] = round(ref["ms_per_step"] / cell["ms_per_step"], 2)
                firsts = [_first_divergence(a, b) for a, b in zip(ref["token_ids"], cell["token_ids"], strict=True)]
                entry[name]["greedy_first_divergence"] = firsts  # None: identical for all tokens
        summary[f"rows_{rows}"] = entry

    checks: dict[str, Any] = {}
    if llama is not None:
        checks["llama_embeddings_input"] = _embeddings_check(llama, loaded, prompts, row_counts)

    result = {
        "what": "greedy decode ms per step (EOS ignored), (t(tokens+short) - t(short)) / tokens; better of the rounds",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git_head(),
        "machine": {
            "cpu_model": _cpu_model(),
            "platform": platform.platform(),
            "env": collect_env(cfg),
        },
        "load_start_end": [cells[0]["load_before"] if cells else _loadavg(), _loadavg()],
        "settings": {
            "model": args.model,
            "tokens": args.tokens,
            "short": args.short,
            "repeats": args.repeats,
            "threads": threads,
            "prompt_tokens": [len(p) for p in prompts],
            "torch": torch.__version__,
        },
        "setup": setup,
        "skipped": skipped,
        "summary": summary,
        "checks": checks,
        "cells": [{k: v for k, v in c.items() if k != "token_ids"} for c in cells],
    }
    if llama is not None:
        llama.close()
    text = json.dumps(result, indent=None if args.json else 2, default=str)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(text)


def _embeddings_check(
    llama: LlamaEngine, loaded: Any, prompts: list[list[int]], row_counts: list[int]
) -> dict[str, Any]:
    """Does llama.cpp take input embeddings per sequence? The prompts' own token embeddings (the prepared
    folder's float32 table: the GGUF's dequantized values) must give the tokens the ids give; a 20-vector
    soft prompt per row must decode too."""
    import numpy as np
    from safetensors import safe_open

    folder = Path(loaded.info.path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        table = fh.get_tensor("model.embed_tokens.weight").float().numpy()
    out: dict[str, Any] = {}
    steps = 16
    for rows in row_counts:
        batch = prompts[:rows]
        by_ids = llama.generate(batch, steps)
        try:
            by_embeds = llama.generate(batch, steps, embeds=[table[p] for p in batch])
        except Exception as exc:  # the answer is the finding
            out[f"rows_{rows}"] = {"accepted": False, "error": str(exc)}
            continue
        rng = np.random.default_rng(0)
        soft = [
            np.concatenate([table[p[:8]], rng.normal(0, table.std(), (20, table.shape[1])), table[p[8:]]])
            for p in batch
        ]
        with_soft = llama.generate(batch, steps, embeds=soft)
        out[f"rows_{rows}"] = {
            "accepted": True,
            "same_tokens_as_ids": [a == b for a, b in zip(by_ids, by_embeds, strict=True)],
            "soft_prompt_decoded_tokens": [len(r) for r in with_soft],
            "soft_prompt_changed_output": [a != b for a, b in zip(by_ids, with_soft, strict=True)],
        }
    return out


def _git_head() -> str | None:
    import subprocess

    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    return None


if __name__ == "__main__":
    main()
