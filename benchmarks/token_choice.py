"""The cost of choosing a token from a step's logits: three inverse-CDF samplers, milliseconds per call.

- ``flat_fp32``: a float32 scan over the whole vocabulary (the sampler before counter-based draws);
- ``flat_fp64``: the same scan in float64 (what the H200 run of 7a2a29f measured: 0.23 ms a step);
- ``two_level``: :func:`elm_memory.backends.sampling.inverse_cdf`, blocks of 128 then the token inside;
- ``pick_tokens``: the whole choice as the decode loops run it (softmax, draws, two-level inverse CDF,
  greedy rows beside sampled ones).

Random logits of the default model's vocabulary (151,936), temperature 0.8, on the chosen device:

    python -m benchmarks.token_choice --out benchmarks/results/token_choice_cpu.json
    python -m benchmarks.token_choice --device cuda --out token_choice_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _time(fn: Callable[[], Any], sync: Callable[[], None], calls: int, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return round(best * 1000, 4)


def _flat(probs: Any, u: Any, dtype: Any) -> Any:
    """The inverse CDF as one scan over the whole vocabulary, in ``dtype``."""
    import torch

    cdf = probs.to(dtype).cumsum(dim=-1)
    return torch.searchsorted(cdf, (u.to(dtype) * cdf[:, -1]).unsqueeze(1), right=True)


def _measure(
    rows: int, vocab: int, device: Any, g: Any, sync: Callable[[], None], calls: int, repeats: int
) -> dict[str, float]:
    import torch

    from elm_memory.backends.sampling import inverse_cdf, pick_tokens

    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    probs = torch.softmax(logits / 0.8, dim=-1)
    u = torch.rand(rows, generator=g).to(device)
    temperature = torch.full((rows,), 0.8, device=device)
    temperature[0] = 0.0  # one greedy row beside the sampled ones
    top_p = torch.ones(rows, device=device)
    keys = torch.arange(rows, device=device)
    counts = torch.zeros(rows, dtype=torch.long, device=device)
    return {
        "flat_fp32": _time(lambda: _flat(probs, u, torch.float32), sync, calls, repeats),
        "flat_fp64": _time(lambda: _flat(probs, u, torch.float64), sync, calls, repeats),
        "two_level": _time(lambda: inverse_cdf(probs, u), sync, calls, repeats),
        "pick_tokens": _time(
            lambda: pick_tokens(logits, temperature, top_p, keys, counts, any_sampled=True, any_nucleus=False),
            sync,
            calls,
            repeats,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from elm_memory.hardware import Hardware

    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    result: dict[str, Any] = {
        "what": "ms per call of each token sampler; random logits, temperature 0.8",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hardware": Hardware.detect().to_dict(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "vocab": args.vocab,
        "rows": {},
    }
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        row = _measure(rows, args.vocab, device, g, sync, args.calls, args.repeats)
        result["rows"][str(rows)] = row
        print(json.dumps({"rows": rows, **row}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
