"""Benchmark: transformers' ``eager`` attention against ``sdpa`` on this CPU, default model.

``model.attn_implementation: auto`` picks the kernel per machine (``elm_memory/hardware.py``). On a
2-core AMD EPYC (AVX512-BF16) the SDPA kernel made one-token decode steps 1.5-1.9x slower at batch 32,
so CPUs got ``eager``; this script measures the same thing on whatever machine runs it, so the rule
rests on numbers per CPU kind. Both kernels are loaded side by side and timed alternately (twice each,
best median), so a drift in machine speed hits both alike:

- ``decode``: B rows whose KV cache holds P tokens, one new token per step (what answering and
  rollouts spend their time in; P=150 is a prompt, P=400 the end of a long answer);
- ``train``: G=4 rows of an 80-token prompt and 256 completion tokens, forward and backward into the
  input embeddings (what a memory's GRPO step does after its rollouts).

Also how far apart the two kernels' logits are on the same inputs (largest and mean difference, and
how often their argmax agrees): bf16 rounding, not a different model.

    .venv/bin/python -m benchmarks.attention_kernel --out benchmarks/results/attention_kernel.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.demo_settings import write_report
from elm_memory.config import ELMConfig
from elm_memory.models.loading import load_model

KERNELS = ("eager", "sdpa")


def _decode(model: Any, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Median seconds per one-token step after a prefill of ``ids``; the prefill's last logits (the
    steps after it feed each kernel's own argmax, which may differ between kernels at a near-tie)."""
    B, P = ids.shape
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill = out.logits[:, -1].float()
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.ones(B, P + 1, dtype=torch.long)
    pos = torch.full((B, 1), P)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
    return statistics.median(times[2:]), prefill  # the first steps warm the allocator


def _train(model: Any, emb: torch.Tensor, completion: int) -> tuple[float, torch.Tensor]:
    """Seconds for one forward and backward of ``emb`` (the completion positions' logits)."""
    e = emb.clone().requires_grad_(True)
    t0 = time.perf_counter()
    logits = model(inputs_embeds=e, logits_to_keep=completion + 1).logits
    logits.float().logsumexp(-1).mean().backward()
    return time.perf_counter() - t0, logits.detach().float()


def _alternate(models: dict[str, Any], run: Any, rounds: int = 2) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {k: [] for k in models}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(rounds):
        for name, model in models.items():
            s, outputs[name] = run(model)
            seconds[name].append(s)
    best = {k: min(v) for k, v in seconds.items()}
    diff = outputs["eager"] - outputs["sdpa"]
    return {
        "eager_ms": round(best["eager"] * 1e3, 1),
        "sdpa_ms": round(best["sdpa"] * 1e3, 1),
        "eager_over_sdpa": round(best["eager"] / best["sdpa"], 2),
        "max_abs_logit_diff": round(float(diff.abs().max()), 4),
        "mean_abs_logit_diff": round(float(diff.abs().mean()), 4),
        "same_argmax": round(float((outputs["eager"].argmax(-1) == outputs["sdpa"].argmax(-1)).float().mean()), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per case and round")
    ap.add_argument("--batches", default="1,6,12,32")
    ap.add_argument("--contexts", default="150,400")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_kernel.json")
    args = ap.parse_args()
    cfg = ELMConfig.load(preset="cpu-demo")
    models = {k: load_model(cfg.model.model_copy(update={"attn_implementation": k})).model for k in KERNELS}
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for P in (int(x) for x in args.contexts.split(",")):
            for B in (int(x) for x in args.batches.split(",")):
                ids = torch.randint(100, 20000, (B, P), generator=gen)
                row = {"case": "decode", "batch": B, "context": P}
                row |= _alternate(models, lambda m, ids=ids: _decode(m, ids, args.steps))
                rows.append(row)
                print(json.dumps(row), flush=True)
    G, prompt, completion = 4, 80, 256
    ids = torch.randint(100, 20000, (G, prompt + completion), generator=gen)
    emb = models["eager"].get_input_embeddings()(ids).detach()
    row = {"case": "train", "batch": G, "context": prompt + completion}
    row |= _alternate(models, lambda m: _train(m, emb, completion))
    rows.append(row)
    print(json.dumps(row), flush=True)
    write_report(args.out, "attention_kernel", rows, torch=torch.__version__)


if __name__ == "__main__":
    main()
