"""Token log-probs from (8, 256, 151,936) bf16 logits and their backward: the plain autograd expression the
library used before against ``teacher_forcing._TokenLogprobs``, alternating, two rounds, one process.

    .venv/bin/python benchmarks/results/token_logprobs/microbench.py
"""

import time

import torch

from elm_memory.backends.teacher_forcing import _TokenLogprobs

ROWS, LENGTH, VOCAB, TEMPERATURE = 8, 256, 151936, 0.8
gen = torch.Generator().manual_seed(0)
first = (3 * torch.randn(ROWS, 1, VOCAB, generator=gen)).to(torch.bfloat16)
rest = (3 * torch.randn(ROWS, LENGTH - 1, VOCAB, generator=gen)).to(torch.bfloat16)
targets = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
upstream = torch.randn(ROWS, LENGTH, generator=gen)


def plain(pieces: list[torch.Tensor]) -> torch.Tensor:
    logits = torch.cat(pieces, dim=1)  # the shared-prompt path joined its two pieces
    out = []
    for i, row_logits in enumerate(logits.unbind(0)):
        row = row_logits.float() / TEMPERATURE
        out.append(row.gather(1, targets[i].unsqueeze(1)).squeeze(1) - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


def written_out(pieces: list[torch.Tensor]) -> torch.Tensor:
    return _TokenLogprobs.apply(TEMPERATURE, targets, *pieces)


results: dict[str, list[tuple[float, float]]] = {"plain": [], "written_out": []}
grads: dict[str, torch.Tensor] = {}
for _ in range(2):
    for name, fn in (("plain", plain), ("written_out", written_out)):
        pieces = [first.clone().requires_grad_(True), rest.clone().requires_grad_(True)]
        t0 = time.perf_counter()
        out = fn(pieces)
        t1 = time.perf_counter()
        out.backward(upstream)
        t2 = time.perf_counter()
        results[name].append((round(t1 - t0, 3), round(t2 - t1, 3)))
        grads[name] = torch.cat([p.grad for p in pieces], dim=1)
        print(f"{name:12s} forward {t1 - t0:.3f} s  backward {t2 - t1:.3f} s", flush=True)
print("gradients equal bit for bit:", torch.equal(grads["plain"], grads["written_out"]))
