"""Issue #66: one- and two-row answer decode, the plain loop against torch int4 and llama.cpp, in one run.

    python -m benchmarks.answer_rows --json

Engines, on the packaged model loaded as the library loads it (prepacked weights, the resolved attention
and threads):

- ``plain``: the ``hf`` backend with ``backend.one_row_engine: plain`` (its own decode loop);
- ``int4``: the ``hf`` backend with ``one_row_engine: int4`` (``elm_memory/backends/int4.py``: the linear
  layers int4, group 32, the output layer kept: ``backend.int4_lm_head: false``, the default);
- ``int4_head``: the same with ``int4_lm_head: true``, the output layer int4 too (what #54's pilot timed);
  reported beside, so a quiet run shows what keeping the output layer costs;
- ``llama``: the ``hf`` backend with ``one_row_engine: llama`` (``elm_memory/backends/llama_rows.py``: llama.cpp
  on the packaged GGUF, a soft prompt's rows fed as input embeddings, a LoRA written as an adapter file);
  absent when ``llama_cpp`` does not import (the optional extra ``elm-memory[llama]``, a source build).

Cases: 1 row (one question) and 2 rows (two questions, one row each), each with a soft prompt (k=20 vectors
initialised from another question's token embeddings, at the user turn, as a retrieved memory is) and with
a LoRA memory (rank ``memory.lora_rank`` on every projection, B drawn nonzero so its delta is computed).
Greedy, EOS ignored, so every row runs to the cap. A step's cost is ``(t(short + tokens) - t(short)) /
tokens``: the prefill and per-call work cancel out. Cells alternate between the engines, ``--repeats``
rounds; the better round counts. The load average is recorded around each cell: ratios mean something only
on quiet cores.

Prints one JSON object: ``ratio_1row_int4``, ``ratio_1row_llama``, ``ratio_2row_int4``, ``ratio_2row_llama``
(plain ms per step / engine ms per step, in the soft-prompt cases, the issue's targets; null where the
engine is absent), every case's ratios under ``ratios``, and the machine. Also written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cpu_decode_pilot import QUESTIONS, _cpu_model, _first_divergence, _git_head, _loadavg

RESULTS = Path(__file__).parent / "results" / "answer_rows.json"
ENGINES = ("plain", "int4", "int4_head", "llama")
MEMORIES = ("soft_prompt", "lora")
SOFT_PROMPT_TOKENS = 20

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

Runner = Callable[[int], list[list[int]]]  # new tokens per row -> each row's token ids


def summarize(cells: list[dict[str, Any]], engines: list[str]) -> dict[str, Any]:
    """The better round of each (rows, memory, engine), its ratio to plain's, and the four headline ratios
    (soft-prompt cases; None where an engine has no cell)."""
    ratios: dict[str, dict[str, float | None]] = {}
    best: dict[tuple[int, str, str], dict[str, Any]] = {}
    for c in cells:
        key = (c["rows"], c["memory"], c["engine"])
        if key not in best or c["ms_per_step"] < best[key]["ms_per_step"]:
            best[key] = c
    for rows, memory in sorted({(r, m) for r, m, _ in best}):
        plain = best.get((rows, memory, "plain"))
        case: dict[str, float | None] = {}
        for engine in engines:
            if engine == "plain":
                continue
            cell = best.get((rows, memory, engine))
            if plain is None or cell is None or cell["ms_per_step"] <= 0:
                case[engine] = None
            else:
                case[engine] = round(plain["ms_per_step"] / cell["ms_per_step"], 2)
        ratios[f"{rows}row_{memory}"] = case
    out: dict[str, Any] = {}
    for rows in (1, 2):
        for engine in ("int4", "llama"):
            out[f"ratio_{rows}row_{engine}"] = ratios.get(f"{rows}row_soft_prompt", {}).get(engine)
    out["ratios"] = ratios
    out["ms_per_step"] = {
        f"{r}row_{m}": {e: best[(r, m, e)]["ms_per_step"] for e in engines if (r, m, e) in best}
        for r, m in sorted({(r, m) for r, m, _ in best})
    }
    return out


def _cell(run: Runner, tokens: int, short: int) -> dict[str, Any]:
    load_before = _loadavg()
    time.sleep(0.5)  # let another engine's worker threads stop spinning
    t0 = time.perf_counter()
    run(short)
    t_short = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(short + tokens)
    t_long = time.perf_counter() - t0
    step = (t_long - t_short) / tokens
    return {
        "ms_per_step": round(step * 1e3, 2),
        "short_call_s": round(t_short, 3),
        "long_call_s": round(t_long, 3),
        "load_before": load_before,
        "load_after": _loadavg(),
        "token_ids": out,
    }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="packaged:qwen2.5-coder-0.5b")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--memories", default=",".join(MEMORIES))
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens timed per row")
    ap.add_argument("--short", type=int, default=8, help="the short call subtracted (prefill and per-call work)")
    ap.add_argument("--repeats", type=int, default=2, help="timing rounds (0: no timing, e.g. with --drift-tokens)")
    ap.add_argument(
        "--drift-tokens",
        type=int,
        default=0,
        help="also measure the int4 engines' drift on this many greedy tokens of each of the 8 questions (0: off)",
    )
    ap.add_argument(
        "--answers",
        type=int,
        default=0,
        help="also time this many whole one-row answers under the LoRA (a served stream memory's answer: EOS and "
        "the answer stop honoured, --answer-tokens at most) per hf engine, wall seconds each (0: off)",
    )
    ap.add_argument("--answer-tokens", type=int, default=384, help="the answers' token budget (the product's: 384)")
    ap.add_argument("--threads", type=int, default=0, help="threads for every engine (0: what the library resolves)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on one line")
    ap.add_argument("--out", type=Path, default=RESULTS, help="also write the result here")
    return ap.parse_args()


def main() -> None:
    args = _args()
    import torch

    from elm_memory.backends.base import PromptInput, SamplingParams
    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.int4 import int4_bytes, int4_model
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig
    from elm_memory.environment import collect_env
    from elm_memory.memory.init import init_soft_prompt
    from elm_memory.memory.lora import LoraAdapter
    from elm_memory.models.loading import load_model

    over: dict[str, Any] = {"name_or_path": args.model}
    if args.threads:
        over["num_threads"] = args.threads
    cfg = ELMConfig.load(overrides={"model": over, "backend": {"one_row_engine": "plain"}})
    loaded = load_model(cfg.model)
    threads = torch.get_num_threads()
    tok = loaded.tokenizer
    builder = PromptBuilder(tok, cfg.prompt, loaded.info.max_context)
    row_counts = [int(r) for r in args.rows.split(",")]
    memories = [m.strip() for m in args.memories.split(",") if m.strip()]
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "plain" not in wanted:
        wanted.insert(0, "plain")  # every ratio is against it

    # the answers' prompts: question i, with a soft prompt made from question i + 4's tokens (another question)
    answers = [builder.answer_prompt(q, memory_tokens=SOFT_PROMPT_TOKENS) for q in QUESTIONS[: max(row_counts)]]
    embedding = loaded.model.get_input_embeddings()
    softs = [
        init_soft_prompt(embedding, tok(QUESTIONS[i + 4], add_special_tokens=False)["input_ids"], SOFT_PROMPT_TOKENS)
        for i in range(len(answers))
    ]
    start = LoraAdapter.initial(loaded.model, rank=cfg.memory.lora_rank, alpha=cfg.memory.lora_alpha, seed=0)
    gen = torch.Generator().manual_seed(0)
    lora = LoraAdapter(
        {name: (a, torch.randn(b.shape, generator=gen) * 1e-3) for name, (a, b) in start.weights.items()},
        start.alpha,
    )
    inputs = {
        "soft_prompt": [a.with_memory(s) for a, s in zip(answers, softs, strict=True)],
        "lora": [PromptInput(a.token_ids, memory=lora) for a in answers],
    }

    skipped: dict[str, str] = {}
    setup: dict[str, Any] = {"threads": threads}
    backends: dict[str, HFBackend] = {}
    for name in wanted:
        if name == "plain":
            backends[name] = HFBackend.from_config(cfg, loaded)
        elif name in ("int4", "int4_head"):
            settings = {"one_row_engine": "int4", "int4_lm_head": name == "int4_head"}
            backend_cfg = cfg.backend.model_copy(update=settings)
            backend = HFBackend.from_config(cfg.model_copy(update={"backend": backend_cfg}), loaded)
            if backend.one_row_engine != "int4":
                skipped[name] = backend.one_row_reason
                continue
            t0 = time.perf_counter()
            tree = int4_model(loaded.model, lm_head=backend.one_row.int4_lm_head)
            setup[name] = {"quantize_s": round(time.perf_counter() - t0, 1), "int4_bytes": int4_bytes(tree)}
            backends[name] = backend
        elif name == "llama":
            backend_cfg = cfg.backend.model_copy(update={"one_row_engine": "llama"})
            backend = HFBackend.from_config(cfg.model_copy(update={"backend": backend_cfg}), loaded)
            if backend.one_row_engine != "llama":
                skipped[name] = backend.one_row_reason
                continue
            t0 = time.perf_counter()
            engine = backend.one_row.llama()
            setup[name] = {"load_s": round(time.perf_counter() - t0, 1), "gguf": str(engine.gguf)}
            backends[name] = backend
    eos_ids = {name: list(backend.eos_ids) for name, backend in backends.items()}
    for backend in backends.values():
        backend.eos_ids = []  # EOS ignored: every row runs to the cap, so every call times the same steps

    def hf_runner(backend: HFBackend, prompts: list[PromptInput]) -> Runner:
        def run(n: int) -> list[list[int]]:
            return [g[0].token_ids for g in backend.generate(prompts, SamplingParams(max_new_tokens=n))]

        return run

    runners: dict[tuple[int, str, str], Runner] = {}
    for rows in row_counts:
        for memory in memories:
            for name, backend in backends.items():
                runners[(rows, memory, name)] = hf_runner(backend, inputs[memory][:rows])

    for run in runners.values() if args.repeats else ():  # warm-up: kernels' first calls, the int4 tree
        run(2)
    calls_before = {name: dict(b.engine_calls) for name, b in backends.items()}

    cells: list[dict[str, Any]] = []
    for round_ in range(args.repeats):
        for (rows, memory, name), run in runners.items():
            cell = _cell(run, args.tokens, args.short)
            cell.update(engine=name, rows=rows, memory=memory, round=round_ + 1)
            cells.append(cell)
            print(
                f"round {round_ + 1} rows {rows} {memory} {name}: {cell['ms_per_step']} ms/step "
                f"(load {cell['load_before']})",
                file=sys.stderr,
            )

    divergence: dict[str, dict[str, list[int | None]]] = {}
    for rows in row_counts:
        for memory in memories:
            ref = next((c for c in cells if (c["rows"], c["memory"], c["engine"]) == (rows, memory, "plain")), None)
            if ref is None:
                continue
            divergence[f"{rows}row_{memory}"] = {
                c["engine"]: [_first_divergence(a, b) for a, b in zip(ref["token_ids"], c["token_ids"], strict=True)]
                for c in cells
                if (c["rows"], c["memory"], c["round"]) == (rows, memory, 1) and c["engine"] != "plain"
            }

    whole_answers = None
    if args.answers:
        for name, backend in backends.items():
            backend.eos_ids = eos_ids[name]
        questions = [builder.answer_prompt(q, memory_tokens=SOFT_PROMPT_TOKENS) for q in QUESTIONS[: args.answers]]
        whole_answers = _whole_answers(backends, [PromptInput(a.token_ids, memory=lora) for a in questions], args)

    engines = [e for e in wanted if e in backends]
    summary = summarize(cells, engines)
    result = {
        **{k: summary[k] for k in ("ratio_1row_int4", "ratio_1row_llama", "ratio_2row_int4", "ratio_2row_llama")},
        "machine": {
            "cpu_model": _cpu_model(),
            "platform": platform.platform(),
            "load_start_end": [cells[0]["load_before"] if cells else _loadavg(), _loadavg()],
            "env": collect_env(cfg),
        },
        "what": "greedy decode ms per step (EOS ignored), (t(tokens+short) - t(short)) / tokens; better round",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git_head(),
        "ratios": summary["ratios"],
        "ms_per_step": summary["ms_per_step"],
        "greedy_first_divergence": divergence,  # None: the same tokens as plain for the whole row
        "engine_calls": {
            name: {k: v - calls_before[name].get(k, 0) for k, v in b.engine_calls.items()}
            for name, b in backends.items()
        },
        "settings": {
            "model": args.model,
            "tokens": args.tokens,
            "short": args.short,
            "repeats": args.repeats,
            "soft_prompt_tokens": SOFT_PROMPT_TOKENS,
            "lora_rank": cfg.memory.lora_rank,
            "prompt_tokens": [len(a.token_ids) for a in answers],
            "torch": torch.__version__,
        },
        "setup": setup,
        "skipped": skipped,
        "drift": _drift(loaded, builder, args.drift_tokens) if args.drift_tokens else None,
        "whole_answers": whole_answers,
        "cells": [{k: v for k, v in c.items() if k != "token_ids"} for c in cells],
    }
    text = json.dumps(result, indent=None if args.json else 2, default=str)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(text)


def _whole_answers(backends: dict[str, Any], prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Each question answered alone under the LoRA, as amortized serving answers (greedy, EOS and the answer stop
    honoured), per hf engine in turn: wall seconds (prefill, decode and, for int4's first call under this LoRA,
    merging it in: reported apart as ``first_call_s``), tokens and whether the answer is boxed. Engines alternate
    per question, so a load change falls on both."""
    from elm_memory.backends.base import SamplingParams

    params = SamplingParams(max_new_tokens=args.answer_tokens, stop_at_answer=True)
    first_call_s = {}
    for name, backend in backends.items():  # the first call under the LoRA (int4: the merge, if not made yet)
        t0 = time.perf_counter()
        backend.generate(prompts[:1], SamplingParams(max_new_tokens=2))
        first_call_s[name] = round(time.perf_counter() - t0, 2)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    for prompt in prompts:
        for name, backend in backends.items():
            t0 = time.perf_counter()
            [[gen]] = backend.generate([prompt], params)
            rows[name].append(
                {
                    "seconds": round(time.perf_counter() - t0, 2),
                    "tokens": len(gen.token_ids),
                    "boxed": "\\boxed" in gen.text,
                    "load": _loadavg(),
                }
            )
    out: dict[str, Any] = {"answer_tokens": args.answer_tokens, "questions": len(prompts)}
    for name, got in rows.items():
        seconds, tokens = sum(r["seconds"] for r in got), sum(r["tokens"] for r in got)
        out[name] = {
            "mean_seconds": round(seconds / len(got), 2),
            "mean_tokens": round(tokens / len(got), 1),
            "ms_per_token": round(1e3 * seconds / max(tokens, 1), 1),
            "first_call_s": first_call_s[name],
            "answers": got,
        }
    return out


def _drift(loaded: Any, builder: Any, tokens: int) -> dict[str, Any]:
    """How far the int4 trees' next-token distributions are from the plain model's, teacher-forced on the plain
    loop's own greedy tokens (``tokens`` per question, EOS ignored), with the int4 product at every position
    (the engine itself prefills with the layers' own product): the share of positions whose top token agrees
    and the mean KL(plain || int4) in nats; and where each engine's own greedy tokens (as it decodes: prefill
    dense, steps int4) first differ from the plain loop's (None: nowhere). Deterministic for a CPU kind: it
    does not depend on the load. Group 32 (the engine's) and, for comparison, 64 and 128."""
    import torch

    from elm_memory.backends import decode, int4
    from elm_memory.backends.int4 import int4_model

    model = loaded.model
    variants = {
        "int4": int4_model(model),
        "int4_head": int4_model(model, lm_head=True),
        "int4_group64": int4_model(model, group=64),
        "int4_group128": int4_model(model, group=128),
    }
    out: dict[str, dict[str, Any]] = {name: {"top1": [], "kl": [], "first_divergence": []} for name in variants}

    def greedy(m: Any, ids: list[int]) -> list[int]:
        options = decode.DecodeOptions(max_new_tokens=tokens)
        row = torch.tensor([ids])
        return decode.sample(m, torch.ones_like(row), options, input_ids=row, eos_ids=())[0][0]

    with torch.no_grad():
        for question in QUESTIONS:
            ids = list(builder.build(question).token_ids)
            ref = greedy(model, ids)
            full = torch.tensor([ids + ref])
            p = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1 : -1].float(), -1)
            for name, tree in variants.items():
                dense_above, int4.INT4_MAX_TOKENS = int4.INT4_MAX_TOKENS, full.shape[1]  # int4 at every position
                try:
                    q = torch.log_softmax(tree(input_ids=full).logits[0, len(ids) - 1 : -1].float(), -1)
                finally:
                    int4.INT4_MAX_TOKENS = dense_above
                out[name]["top1"].append((p.argmax(-1) == q.argmax(-1)).float().mean().item())
                out[name]["kl"].append((p.exp() * (p - q)).sum(-1).mean().item())
                out[name]["first_divergence"].append(_first_divergence(ref, greedy(tree, ids)))
    return {
        "tokens": tokens,
        "questions": len(QUESTIONS),
        **{
            name: {
                "top1_agreement": round(sum(r["top1"]) / len(r["top1"]), 4),
                "mean_kl": round(sum(r["kl"]) / len(r["kl"]), 4),
                "first_divergence": r["first_divergence"],
            }
            for name, r in out.items()
        },
    }


if __name__ == "__main__":
    main()
