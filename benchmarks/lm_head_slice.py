"""Benchmark: ``logits_to_keep`` as a count against an index tensor, on the default model.

transformers slices the last hidden states before the lm_head with ``logits_to_keep``. A count
(``logits_to_keep=1``) gives a strided view of the (B, L, hidden) states; ``torch.matmul`` cannot fold
such a view into one matrix product and instead expands the lm_head weight to (B, hidden, vocab),
copying the whole 151936 x 896 embedding matrix once per row before a batched product. An index tensor
slices by advanced indexing: a small contiguous copy of the activations, then one ordinary product.

Measured here, in one process, alternating the two ways (median of ``--repeats``):

- ``prefill``: a batch of B prompts of about 80 tokens, last position's logits (what every decode,
  KV-prefix and prefix-memory prefill asks for);
- ``train``: G=4 rows of prompt + 160 completion tokens, the completion positions' logits, forward and
  backward into the input embeddings (what teacher forcing does when it does not share the prompt).

Also the largest absolute difference between the two ways' logits (they compute the same products).

    .venv/bin/python -m benchmarks.lm_head_slice --out benchmarks/results/lm_head_slice.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from elm_memory.config import ELMConfig
from elm_memory.environment import collect_env
from elm_memory.models.loading import load_model

QUESTION = (
    "A warehouse receives 3 packs of 16 candles each. It ships out 12 candles on the first day and twice "
    "as many on the second day. How many candles remain in the warehouse? Please reason step by step."
)


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _compare(ways: dict[str, Any], run: Any, repeats: int) -> dict[str, Any]:
    """Both ways, alternated twice (a drift in machine speed hits both alike): best median seconds
    of each, and the largest difference between their outputs."""
    run(next(iter(ways.values())))  # warm-up
    seconds: dict[str, list[float]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(2):
        for name, keep in ways.items():
            s, outputs[name] = _timed(lambda keep=keep: run(keep), repeats)
            seconds.setdefault(name, []).append(s)
    return {
        "count_s": round(min(seconds["count"]), 3),
        "index_s": round(min(seconds["index"]), 3),
        "max_abs_logit_diff": float((outputs["count"].float() - outputs["index"].float()).abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lm_head_slice.json")
    args = ap.parse_args()
    cfg = ELMConfig.load(preset="cpu-demo")
    loaded = load_model(cfg.model)
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    L = len(ids)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for batch in (1, 2, 8):
            x = torch.tensor([ids] * batch)
            ways = {"count": 1, "index": torch.tensor([L - 1])}
            row = {"case": "prefill", "batch": batch, "prompt_tokens": L}
            row |= _compare(ways, lambda keep, x=x: model(input_ids=x, logits_to_keep=keep).logits, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    T, G = 160, 4
    gen = torch.Generator().manual_seed(0)
    comp = torch.randint(0, 1000, (G, T), generator=gen)
    full = torch.cat([torch.tensor([ids] * G), comp], dim=1)
    emb = model.get_input_embeddings()(full).detach()
    ways = {"count": T + 1, "index": torch.arange(full.shape[1] - T - 1, full.shape[1])}

    def step(keep: Any) -> torch.Tensor:
        e = emb.clone().requires_grad_(True)
        out = model(inputs_embeds=e, logits_to_keep=keep).logits
        out.float().logsumexp(-1).mean().backward()
        return out.detach()

    row = {"case": "train", "batch": G, "prompt_tokens": L, "completion_tokens": T}
    row |= _compare(ways, step, args.repeats)
    rows.append(row)
    print(json.dumps(row), flush=True)
    report = {
        "benchmark": "lm_head_slice",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "rows": rows,
        "environment": {k: v for k, v in collect_env(cfg).items() if k in ("cpu", "resolved")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
