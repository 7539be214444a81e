"""The embedding-table fingerprint: which vector space a memory lives in.

A soft prompt is only meaningful for the model whose input embeddings it was trained against,
so every memory records this fingerprint and is checked against the loaded model's. Both the
GGUF preparation (which stores it once) and model loading (which reads or computes it) use it.
"""

from __future__ import annotations

import hashlib
from typing import Any


def weight_fingerprint(weight: Any) -> str:
    """sha256 (16 hex) of an embedding table in float32: identifies the vector space memories live in."""
    import torch

    table = weight.detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256()
    h.update(str(tuple(table.shape)).encode())
    h.update(table.numpy().tobytes())
    return h.hexdigest()[:16]


def embedding_fingerprint(model: Any) -> str:
    """The fingerprint of a model's input embedding table (see :func:`weight_fingerprint`)."""
    return weight_fingerprint(model.get_input_embeddings().weight)
