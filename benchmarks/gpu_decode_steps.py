"""GPU decode steps: milliseconds per step of the HF backend's decode loop, case by case, first call
and repeat, and a profile of where a step's time goes.

Same model as ``gpu_check.py``: the default model's architecture with random weights (bf16 on the
GPU), so every case runs to its cap. Each case is decoded twice with identical inputs: ``first`` is
the first time its shapes (batch rows x KV length) are seen in the process, ``repeat`` the same call
again. A large gap between them is per-shape set-up work (kernel plans, autotuning), not decoding.

    python -m benchmarks.gpu_decode_steps --config-dir DIR --out results.json
    python -m benchmarks.gpu_decode_steps --config-dir DIR --sdpa no-cudnn   # cuDNN attention off

``--sdpa``: ``auto`` leaves PyTorch's choice of attention kernel; ``no-cudnn`` disables its cuDNN
kernel (``torch.backends.cuda.enable_cudnn_sdp(False)``), leaving flash and memory-efficient.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import _random_model_folder, _sync, answer_pair


def _cases(loaded: Any, length: int) -> dict[str, tuple[list[Any], Any]]:
    from elm_memory.backends.base import PromptInput, SamplingParams
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig

    cfg = ELMConfig()
    prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
    p0, p1 = answer_pair(cfg, loaded, prompts)
    seeded = dataclasses.replace(p1, seed=1)
    shorter = PromptInput(p0.token_ids[:-3])
    greedy = SamplingParams(max_new_tokens=length)
    return {
        "greedy, 1 prompt": ([p0], greedy),
        "greedy, 2 prompts, same length": ([p0, p0], greedy),
        "greedy, 2 prompts, left-padded": ([p0, shorter], greedy),
        "greedy, zero-shot + memory (ELM's answer)": ([p0, p1], greedy),
        "sampled, 8 rollouts of a memory (a GRPO step)": (
            [seeded],
            SamplingParams(max_new_tokens=length, temperature=0.8, n=8, seed=1),
        ),
    }


def _ms_per_step(backend: Any, prompts: list[Any], params: Any) -> tuple[float, int]:
    _sync()
    t0 = time.perf_counter()
    out = backend.generate(prompts, params)
    _sync()
    steps = max(len(g.token_ids) for gens in out for g in gens)
    return round(1000 * (time.perf_counter() - t0) / steps, 2), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, required=True, help="the model's config.json and tokenizer files")
    ap.add_argument("--length", type=int, default=128, help="decode steps per case")
    ap.add_argument("--sdpa", choices=["auto", "no-cudnn"], default="auto")
    ap.add_argument("--profile-steps", type=int, default=32, help="steps profiled per case (0: no profile)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from elm_memory.backends.base import SamplingParams
    from elm_memory.backends.hf import HFBackend
    from elm_memory.config import ELMConfig
    from elm_memory.models.loading import load_model

    if args.sdpa == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    folder = _random_model_folder(args.config_dir, "bfloat16" if torch.cuda.is_available() else "float32")
    loaded = load_model(ELMConfig.load(overrides={"model": {"name_or_path": str(folder)}}).model)
    backend = HFBackend(loaded)
    backend.generate(*_cases(loaded, 8)["greedy, 1 prompt"])  # load-time work, not any case's
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "sdpa": args.sdpa,
        "length": args.length,
        "ms_per_step": {},
    }
    cases = _cases(loaded, args.length)
    for name, (prompts, params) in cases.items():
        first, steps = _ms_per_step(backend, prompts, params)
        repeat, _ = _ms_per_step(backend, prompts, params)
        result["ms_per_step"][name] = {"first": first, "repeat": repeat, "steps": steps}
        print(f"{name:48s} first {first:7.2f} ms/step, repeat {repeat:7.2f} ({steps} steps)", flush=True)
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        for name in ("greedy, zero-shot + memory (ELM's answer)", "sampled, 8 rollouts of a memory (a GRPO step)"):
            prompts, params = cases[name]
            short = SamplingParams(**{**params.__dict__, "max_new_tokens": min(args.length, args.profile_steps)})
            with profile(activities=activities) as prof:
                backend.generate(prompts, short)
            print("==", name)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
