"""Which positions reach the lm_head: ``logits_to_keep`` as an index tensor, never as a count.

transformers slices the last hidden states with ``logits_to_keep`` before the lm_head. A count
(``logits_to_keep=1``) makes a strided view of the (B, L, hidden) states, and ``torch.matmul`` cannot
fold such a view into one matrix product: it expands the lm_head weight to (B, hidden, vocab) instead,
copying the whole embedding matrix (151936 x 896 for the default model) once per row. An index tensor
slices by advanced indexing, a small contiguous copy of the activations, and the product stays one
``mm``. Same logits bit for bit, several times faster (measured: docs/results/learn-throughput.md).
"""

from __future__ import annotations

import torch


def last_positions(n: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``logits_to_keep`` for the last ``n`` of ``length`` positions (all of them when ``n >= length``)."""
    return torch.arange(max(0, length - n), length, device=device)
