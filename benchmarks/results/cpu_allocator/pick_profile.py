"""Where the token choice's time goes, ms per call, 8 and 64 rows of random logits (151,936 tokens),
bf16 and fp32; ``--reuse`` first raises glibc's mmap and trim thresholds (what cpu_allocator=reuse does).

    python benchmarks/results/cpu_allocator/pick_profile.py [--reuse]
"""

import ctypes
import sys
import time

import torch

from elm_memory.backends.sampling import inverse_cdf, pick_tokens, uniforms

if "--reuse" in sys.argv:
    libc = ctypes.CDLL("libc.so.6")
    print("mmap", libc.mallopt(-3, 1 << 30), "trim", libc.mallopt(-1, 1 << 30))


def timed(fn, n=10):
    fn()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return round(best * 1000, 2)


def measure(rows, dt):
    x = (torch.randn(rows, 151936) * 3).to(dt)
    temp = torch.full((rows,), 0.8)
    keys, counts, top_p = torch.arange(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    xf = x.float()
    p = torch.softmax(xf, -1)
    flags = {"any_sampled": True, "any_nucleus": False, "any_greedy": False}
    return {
        "float()": timed(lambda: x.float()),
        "div": timed(lambda: xf / temp.unsqueeze(1)),
        "softmax": timed(lambda: torch.softmax(xf, -1)),
        "amax": timed(lambda: xf.amax(-1)),
        "exp": timed(lambda: torch.exp(xf)),
        "blocksum": timed(lambda: p.view(rows, -1, 128).sum(-1)),
        "inv_cdf": timed(lambda: inverse_cdf(p, uniforms(keys, counts))),
        "pick": timed(lambda: pick_tokens(x, temp, top_p, keys, counts, **flags)),
    }


torch.manual_seed(0)
for rows in (8, 64):
    for dt in (torch.bfloat16, torch.float32):
        print(rows, dt, measure(rows, dt), flush=True)
