"""Benchmark: seconds per GRPO training step and trainable parameters, per memory kind, in one run.

The paper's efficiency table (appendix "Compute and Memory Overhead") compares soft prompts with LoRA
memories: parameters and seconds per GRPO step. This measures the three kinds the library trains
(``soft_prompt``, ``lora`` rank 16 on q,k,v,o,gate,up,down, ``prefix``) on one model, one question,
one seed, G and completion length, with the native engine and the ``hf`` backend, in one process
(the model loaded once; a warm-up step first so no kind pays for first-call costs). Every step
back-propagates (``skip_uniform_rewards`` off) and rollouts run to the length cap or EOS
(``stop_at_answer`` off), so a step is the paper's procedure at a smaller G and length. Rollout
lengths still differ between kinds (each samples its own completions): the JSON keeps the completion
tokens, and the per-token times, next to the per-step ones.

    .venv/bin/python -m benchmarks.memory_kinds                          # default model, G=4, 64 tokens, 3 steps
    .venv/bin/python -m benchmarks.memory_kinds --model packaged:smollm2-135m --generations 2 --max-len 8 --steps 1

Writes ``benchmarks/results/memory_kinds.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
RESULTS = Path(__file__).parent / "results" / "memory_kinds.json"
KINDS = ("soft_prompt", "lora", "prefix")


def _lscpu() -> dict[str, Any]:
    """``lscpu``'s model name and the CPU flags that decide the dtype's speed (avx2/avx512/amx)."""
    out: dict[str, Any] = {"model_name": None, "flags": []}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            out["model_name"] = value.strip()
        elif key.strip() == "Flags":
            out["flags"] = sorted(f for f in value.split() if f.startswith(("avx512", "amx")) or f == "avx2")
    return out


def _torch_info() -> dict[str, Any]:
    import torch

    return {
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "cuda": torch.cuda.is_available(),
    }


def _config(args: argparse.Namespace, kind: str) -> Any:
    from elm_memory.config import ELMConfig

    return ELMConfig.load(
        overrides={
            "model": {
                "name_or_path": args.model,
                "dtype": args.dtype,
                "device": args.device,
                "num_threads": args.threads,
            },
            "memory": {"kind": kind, "num_tokens": args.num_tokens},
            "training": {
                "steps": args.steps,
                "num_generations": args.generations,
                "max_completion_length": args.max_len,
                "skip_uniform_rewards": False,
                "stop_at_answer": False,
                "seed": 0,
            },
        }
    )


def _run_kind(kind: str, args: argparse.Namespace, loaded: Any, backend: Any) -> dict[str, Any]:
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.training.learn import learn_memory

    cfg = _config(args, kind)
    prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
    t0 = time.perf_counter()
    memory = learn_memory(QUESTION, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
    wall = time.perf_counter() - t0
    s = memory.meta.stats
    tokens = max(1, s.completion_tokens)
    return {
        "kind": kind,
        "trainable_parameters": memory.num_parameters,
        "share_of_model": memory.num_parameters / sum(p.numel() for p in loaded.model.parameters()),
        "file_bytes": len(memory.to_bytes()),
        "learning_rate": cfg.memory.effective_learning_rate(cfg.training.learning_rate),
        "steps": s.steps,
        "seconds_per_step": wall / max(1, s.steps),
        "generation_seconds_per_step": s.generation_seconds / max(1, s.steps),
        "backward_seconds_per_step": s.backward_seconds / max(1, s.steps),
        "completion_tokens": s.completion_tokens,
        "seconds_per_1k_completion_tokens": 1000 * wall / tokens,
        "backward_seconds_per_1k_completion_tokens": 1000 * s.backward_seconds / tokens,
        "mean_reward": s.mean_reward,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="packaged:qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has native bf16, else float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads; default one per physical core")
    p.add_argument("--generations", type=int, default=4, help="G rollouts per step")
    p.add_argument("--max-len", type=int, default=64, help="rollout length cap in tokens")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-tokens", type=int, default=20, help="k for soft_prompt and prefix (paper: 20)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    from elm_memory.backends.hf import HFBackend
    from elm_memory.config import ModelConfig
    from elm_memory.hardware import Hardware
    from elm_memory.models.loading import load_model
    from elm_memory.models.prepare import prepare_model

    prepare_model(args.model, verbose=False)
    loaded = load_model(
        ModelConfig(name_or_path=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    )
    backend = HFBackend(loaded)
    warm = argparse.Namespace(**{**vars(args), "steps": 1})
    _run_kind("soft_prompt", warm, loaded, backend)  # warm-up: first-call costs land on no kind
    results = []
    for kind in args.kinds.split(","):
        row = _run_kind(kind, args, loaded, backend)
        print(
            f"{kind:<12} {row['trainable_parameters']:>11,} params  {row['seconds_per_step']:7.2f} s/step  "
            f"(generation {row['generation_seconds_per_step']:.2f}, backward {row['backward_seconds_per_step']:.2f}; "
            f"{row['completion_tokens']} completion tokens)",
            flush=True,
        )
        results.append(row)
    report = {
        "benchmark": "memory_kinds",
        "model": args.model,
        "dtype": loaded.info.dtype,
        "settings": {
            "generations": args.generations,
            "max_completion_length": args.max_len,
            "steps": args.steps,
            "num_tokens": args.num_tokens,
            "threads": args.threads,
            "lora_rank": _config(args, "lora").memory.lora_rank,
            "engine": "native",
            "backend": "hf",
        },
        "question": QUESTION,
        "machine": {
            "lscpu": _lscpu(),
            "platform": platform.platform(),
            "hardware": Hardware.detect().to_dict(),
            "torch": _torch_info(),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
