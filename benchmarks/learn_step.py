"""Benchmark: time per memory-training step, native engine vs TRL + PEFT, in one run.

Each configuration runs in its own subprocess (clean peak-RSS, no warm caches shared),
on the same model, dtype, question, seed, G and completion length:

- ``native-faithful``: the paper's procedure (no early stop, every group back-propagated)
- ``native-fast``: speed levers on (stop a rollout once its \\boxed{} closes, skip the
  backward when all rewards are equal)
- ``trl``: TRL GRPOTrainer + PEFT prompt tuning in its fastest configuration
  (gradient checkpointing off; TRL's default turns it on and is ~4x slower here)
- ``floor``: one batched generation of the G rollouts + one forward/backward on them
  (the least a step can cost with this backend)

A native variant named ``NAME@mbN`` runs with ``training.micro_batch_size = N`` (rollouts per
forward/backward); the rollouts are the same tokens, so the rows differ only in how the backward is
batched, and ``peak_rss_mb`` shows what each batching holds.

    .venv/bin/python -m benchmarks.learn_step                    # default model, G=4, 160 tokens, 2 steps
    .venv/bin/python -m benchmarks.learn_step --quick            # SmolLM2 plumbing run
    .venv/bin/python -m benchmarks.learn_step --variants native-faithful,native-faithful@mb1 --max-len 384

Writes ``benchmarks/results/learn_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
RESULTS = Path(__file__).parent / "results" / "learn_step.json"
#: the training settings of each variant
VARIANTS: dict[str, dict[str, Any]] = {
    "native-faithful": dict(engine="native", stop_at_answer=False, skip_uniform_rewards=False),
    "native-fast": dict(engine="native", stop_at_answer=True, skip_uniform_rewards=True),
    "trl": dict(engine="trl", stop_at_answer=False, skip_uniform_rewards=False),
    "floor": dict(engine="native", stop_at_answer=False, skip_uniform_rewards=False),
}


def _config(args: argparse.Namespace, **training):
    from elm_memory.config import ELMConfig

    base = {
        "steps": args.steps,
        "num_generations": args.generations,
        "max_completion_length": args.max_len,
        "seed": 0,
    }
    base.update(training)
    model = {"name_or_path": args.model, "dtype": args.dtype, "device": "cpu"}
    if args.threads:
        model["num_threads"] = args.threads
    return ELMConfig.load(overrides={"model": model, "training": base})


def _split_variant(name: str) -> tuple[str, int | None]:
    """``native-faithful@mb2`` -> (``native-faithful``, 2); a name without ``@mb`` -> (name, None)."""
    base, sep, micro = name.partition("@mb")
    if base not in VARIANTS:
        raise SystemExit(f"learn_step: unknown variant {base!r}; known: {', '.join(VARIANTS)}")
    if not sep:
        return name, None
    if not micro.isdigit() or int(micro) < 1 or not base.startswith("native"):
        raise SystemExit(f"learn_step: bad variant {name!r}: NAME@mbN takes a native variant and N >= 1")
    return base, int(micro)


def _floor_step(cfg: Any, loaded: Any, backend: Any, prompts: Any, question: str) -> dict[str, Any]:
    """The least a step costs: one batched generation of the G rollouts, one forward/backward on them."""
    import torch

    from elm_memory.backends.base import PromptInput
    from elm_memory.training.initialization import init_soft_prompt
    from elm_memory.training.native import NativeTrainer

    built = prompts.build(question)
    q_ids = loaded.tokenizer(question, add_special_tokens=False)["input_ids"]
    init = init_soft_prompt(loaded.model.get_input_embeddings(), q_ids, cfg.memory.num_tokens)
    trainer = NativeTrainer(loaded, backend, cfg.training)
    # the trainer's rollout call: G samples with the soft prompt first, one batched generation
    params = trainer.rollout_params(seed=0)
    prompt = PromptInput(tuple(built.token_ids), soft_prompt=init, soft_prompt_at=0, seed=0)
    t0 = time.perf_counter()
    [rollouts] = backend.generate([prompt], params)
    t1 = time.perf_counter()
    soft = torch.nn.Parameter(init.clone())
    logps, mask = trainer.completion_logps(built.token_ids, soft, 0, [g.token_ids for g in rollouts])
    (-(logps * mask).sum()).backward()
    t2 = time.perf_counter()
    return {
        "generation_s": t1 - t0,
        "forward_backward_s": t2 - t1,
        "step_s": t2 - t0,
        "completion_tokens": sum(len(g.token_ids) for g in rollouts),
    }


def worker(name: str, args: argparse.Namespace) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.models.loading import load_model
    from elm_memory.training.learn import learn_memory

    base, micro = _split_variant(name)
    cfg = _config(args, **VARIANTS[base], micro_batch_size=micro)
    loaded = load_model(cfg.model)
    backend = HFBackend(loaded)
    prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
    out: dict = {"variant": name}
    if base == "floor":
        out.update(_floor_step(cfg, loaded, backend, prompts, args.question))
    else:
        t0 = time.perf_counter()
        memory = learn_memory(
            args.question, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False
        )
        total = time.perf_counter() - t0
        s = memory.meta.stats
        out.update(
            memory_s=total,
            step_s=total / max(1, cfg.training.steps),
            generation_s=s.generation_seconds,
            backward_s=s.backward_seconds,
            mean_reward=s.mean_reward,
            skipped_backward=s.skipped_backward,
            completion_tokens=s.completion_tokens,
        )
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in its own subprocess: its result row, or its last error line."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.learn_step",
        "--worker",
        name,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
    ]
    cmd += ["--generations", str(args.generations), "--max-len", str(args.max_len), "--steps", str(args.steps)]
    cmd += ["--threads", str(args.threads), "--question", args.question]
    print(f"running {name} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        row = {"variant": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    else:
        row = json.loads(line[0][7:])
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def _ratios(by: dict[str, dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    if "trl" in by and "native-faithful" in by:
        ratios["trl_over_native_faithful_step"] = by["trl"]["step_s"] / by["native-faithful"]["step_s"]
    if "trl" in by and "native-fast" in by:
        ratios["trl_over_native_fast_step"] = by["trl"]["step_s"] / by["native-fast"]["step_s"]
    if "floor" in by:
        for v in ("native-faithful", "native-fast"):
            if v in by:
                ratios[f"{v}_over_floor"] = by[v]["step_s"] / by["floor"]["step_s"]
    return ratios


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'variant':18} {'s/step':>8} {'gen s':>8} {'bwd s':>8} {'tokens':>7} {'RSS MB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:18} error: {r['error']}")
            continue
        bwd = r.get("backward_s", r.get("forward_backward_s", 0.0))
        print(
            f"{r['variant']:18} {r['step_s']:8.1f} {r['generation_s']:8.1f} {bwd:8.1f} "
            f"{r['completion_tokens']:7d} {r['peak_rss_mb']:7.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="packaged:qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--variants",
        default="floor,native-faithful,native-fast,trl",
        help="comma-separated; NAME@mbN: a native variant with training.micro_batch_size=N",
    )
    parser.add_argument("--threads", type=int, default=0, help="model.num_threads (0: the library's default)")
    parser.add_argument("--question", default=QUESTION, help="the question learned from (its answers set the cost)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2, G=2, 32 tokens, 1 step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.generations, args.max_len, args.steps = "packaged:smollm2-135m", 2, 32, 1
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)))
        return

    names = args.variants.split(",")
    for name in names:
        _split_variant(name)  # a bad name fails before any model loads
    rows = [_run_variant(name, args) for name in names]
    ratios = _ratios({r["variant"]: r for r in rows if "error" not in r})
    result = {
        "benchmark": "learn_step",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_start": os.getloadavg()},
        "settings": {
            "model": args.model,
            "dtype": args.dtype,
            "G": args.generations,
            "max_completion_length": args.max_len,
            "steps": args.steps,
            "threads": args.threads or "default",
            "question": args.question,
        },
        "rows": rows,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print_table(rows)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
