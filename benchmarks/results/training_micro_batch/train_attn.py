"""One memory-training forward and backward (the library's teacher forcing), one attention kernel per process.

    python train_attn.py KERNEL ROWS PROMPT COMPLETION REPEATS

Prints one JSON line: seconds per repeat, and the peak resident size and its growth over the size after
loading (`ru_maxrss`)."""

import json
import resource
import statistics
import sys
import time

import torch

from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import ELMConfig
from elm_memory.models.loading import load_model


def resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def main() -> None:
    kernel = sys.argv[1]
    rows, prompt, completion, repeats = (int(a) for a in sys.argv[2:6])
    cfg = ELMConfig.load(preset="cpu-demo", overrides={"model": {"attn_implementation": kernel, "num_threads": 1}})
    model = load_model(cfg.model).model
    share = cfg.training.share_prompt_kv
    gen = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(100, 20000, (prompt,), generator=gen).tolist())
    comps = [torch.randint(100, 20000, (completion,), generator=gen).tolist() for _ in range(rows)]
    soft0 = model.get_input_embeddings().weight[100:120].detach().clone()
    base = resident_kb()
    times = []
    for _ in range(repeats):
        soft = soft0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        logps, mask = completion_logprobs(
            model,
            [PromptInput(ids, soft_prompt=soft, soft_prompt_at=0)],
            comps,
            temperature=0.7,
            share_prompt_kv=share,
            pad_id=0,
        )
        (logps * mask).sum().backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {
        "kernel": kernel,
        "rows": rows,
        "tokens": prompt + 20 + completion,
        "share_prompt_kv": share,
        "seconds": [round(t, 2) for t in times],
        "median_s": round(statistics.median(times), 2),
        "rss_after_load_gib": round(base / 2**20, 2),
        "peak_rss_gib": round(peak / 2**20, 2),
        "peak_growth_gib": round((peak - base) / 2**20, 2),
        "grad_norm": round(float(soft.grad.float().norm()), 4),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
