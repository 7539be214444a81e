"""The token choice's float32 scaling at 64 rows x 151,936 tokens (bf16 logits, per-row temperatures): a
new tensor for ``logits.float() / scale`` against the division in place on the float32 copy, then the
softmax; alternating, two rounds, the library's allocator setting applied as a loaded model would.

    .venv/bin/python benchmarks/results/token_logprobs/choice_inplace.py
"""

import time

import torch

from elm_memory.config import ELMConfig
from elm_memory.hardware import apply_allocator, resolve_placement

print("large freed buffers kept:", apply_allocator(resolve_placement(ELMConfig.load(overrides={"model": {}}).model)))
torch.manual_seed(0)
ROWS, VOCAB = 64, 151936
logits = (3 * torch.randn(ROWS, VOCAB)).to(torch.bfloat16)
scale = torch.rand(ROWS) + 0.3


def timed(fn, n: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def new_tensor() -> torch.Tensor:
    return torch.softmax(logits.float() / scale.unsqueeze(1), dim=-1)


def in_place() -> torch.Tensor:
    return torch.softmax(logits.to(torch.float32, copy=True).div_(scale.unsqueeze(1)), dim=-1)


for _ in range(2):
    print(f"new tensor {timed(new_tensor):.2f} ms   in place {timed(in_place):.2f} ms", flush=True)
print("equal bit for bit:", torch.equal(new_tensor(), in_place()))
