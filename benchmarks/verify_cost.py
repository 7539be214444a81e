"""Benchmark: what one forward costs with q new tokens per row instead of one, default model.

Speculative decoding (``backend.lookup_draft_tokens``) feeds each row its picked token plus up to k
drafted ones and keeps the drafts the model agrees with. That pays only where a forward of 1+k
tokens per row costs little more than one of a single token: on a CPU a decode step mostly reads the
weights, so the extra tokens ride along until the matmuls become compute-bound. This script measures
that ratio on whatever machine runs it, for batches like the main job's (1 answer row; 1 answer + 4
rollouts; 1 answer + 8), with a KV cache of P tokens. Each setting is timed twice, interleaved, best
median kept, so a drift in machine speed hits all settings alike.

    .venv/bin/python -m benchmarks.verify_cost --out benchmarks/results/verify_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.demo_settings import write_report
from elm_memory.config import ELMConfig
from elm_memory.models.loading import load_model


def _step_seconds(model: Any, rows: int, new: int, cached: int, repeats: int) -> float:
    """Median seconds of a forward of ``new`` tokens per row on top of a ``cached``-token KV cache
    (the cache is cropped back after each forward, so every repeat sees the same length)."""
    ids = torch.randint(1000, 20000, (rows, cached))
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    x = torch.randint(1000, 20000, (rows, new))
    mask = torch.ones(rows, cached + new, dtype=torch.long)
    pos = torch.arange(cached, cached + new).expand(rows, new)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-new)  # back to `cached` tokens
    return statistics.median(times[1:])  # the first warms the allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,9", help="batch rows (comma-separated)")
    ap.add_argument("--new", default="1,2,3,4,6,9", help="new tokens per row (comma-separated; 1 is the baseline)")
    ap.add_argument("--cached", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/verify_cost.json"))
    args = ap.parse_args()
    cfg = ELMConfig.load(preset="cpu-demo")
    model = load_model(cfg.model).model
    rows = [int(r) for r in args.rows.split(",")]
    news = [int(q) for q in args.new.split(",")]
    best: dict[tuple[int, int], float] = {}
    with torch.no_grad():
        for _ in range(2):  # two interleaved passes, best median kept
            for r in rows:
                for q in news:
                    s = _step_seconds(model, r, q, args.cached, args.repeats)
                    best[(r, q)] = min(best.get((r, q), s), s)
                    print(f"rows {r} new {q}: {s * 1000:.1f} ms", flush=True)
    runs = [{"rows": r, "new_tokens": q, "seconds": round(best[(r, q)], 5)} for r in rows for q in news]
    ratios = {f"rows {r}": {f"{q} tokens": round(best[(r, q)] / best[(r, 1)], 2) for q in news} for r in rows}
    write_report(
        args.out,
        "verify_cost",
        runs,
        cached_tokens=args.cached,
        cost_relative_to_one_token=ratios,
        settings={"dtype": cfg.model.dtype, "attn_implementation": cfg.model.attn_implementation},
    )


if __name__ == "__main__":
    main()
