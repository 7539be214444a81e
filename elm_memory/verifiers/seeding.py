"""Seeds of zero-shot samples that name one sample: (run seed, question, sample index).

Why: a sample drawn as row j of one ``n = k`` call shares its prompt's generator with the other
rows, so its random draws depend on how many rows there are and on when the others finish (a row
that ends early stops taking draws and shifts everyone else's). The same "seeded" sample of a
question then differed between a presampled batch and a call after the disagreement, between
``k = 4`` and ``k = 12``, and between a question alone and in a batch of eight.

Here each sample is its own prompt row (``n = 1``) carrying its own :attr:`PromptInput.seed`, which
the ``hf`` backend turns into a generator of that row alone. Sample j of a question is then the same
draw in any call, batch or ``k``; only the floating-point effect of the batch on the logits remains
(a token flip now and then, where a draw lands among the vocabulary's low-probability tail tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib

from elm_memory.backends.base import PromptInput

__all__ = ["sample_seed", "sample_seeds", "seeded_rows"]


def sample_seed(seed: int, question: str, index: int) -> int:
    """A 31-bit seed for sample ``index`` of ``question`` in a run seeded with ``seed``."""
    digest = hashlib.sha256(f"{seed}\x00{index}\x00{question}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def sample_seeds(seed: int | None, question: str, count: int, start: int = 0) -> list[int | None]:
    """Seeds of samples ``start .. start + count - 1`` (all None: an unseeded run)."""
    if seed is None:
        return [None] * count
    return [sample_seed(seed, question, start + i) for i in range(count)]


def seeded_rows(prompt: PromptInput, seeds: list[int | None]) -> list[PromptInput]:
    """One copy of ``prompt`` per seed: each copy is one sample row with its own generator."""
    return [dataclasses.replace(prompt, seed=s) for s in seeds]
