r"""Equivalence: whether two answers are the same, for scoring and for the majority vote.

Rules of :func:`equivalent`:

1. None (or a non-str) on either side: not equivalent. Two answers that normalise to
   nothing are not equivalent either.
2. Fast path: equal after normalisation (:mod:`elm_memory.answers.normalize`).
3. Otherwise math-verify, symmetrically, under a time limit and a guard against huge
   integers (:mod:`elm_memory.answers.symbolic`). Verdicts are cached.

Decisions on the ambiguous cases:

* ``10\%`` ~ ``10``: the percent sign is dropped, so ``10\%`` is NOT ~ ``0.1`` (math-verify
  alone would say the opposite). A model asked for a percentage boxes ``10`` or ``10\%``,
  both meaning the same answer, and grouping them matters more for the vote than matching
  the rare ``0.1``.
* ``x=5`` ~ ``5`` (math-verify's rule for a single-variable assignment), but ``x=5`` is not
  ~ ``y=5``.
* ``\text{(B)}`` ~ ``(B)`` ~ ``B``. math-verify reads letters as symbols and lower-cases
  them, so ``B`` ~ ``b`` as well.
* Identical strings are equivalent even when they are junk; math-verify reads letters as a
  product of symbols, so ``abc`` ~ ``cab``.

Time limit: ``timeout`` seconds for the math-verify step of one call (the fast path is not
limited; ``timeout=None`` runs without limit; ``<= 0`` uses the fast path only).
"""

from __future__ import annotations

from elm_memory.answers.normalize import normalize_answer
from elm_memory.answers.symbolic import symbolic_equal


def equivalent(a: str | None, b: str | None, *, timeout: float | None = 2.0) -> bool:
    """Whether two answers are the same (see the module doc for the rules).

    Never raises. A comparison that takes longer than ``timeout`` seconds counts as not
    equivalent. Safe to call from any thread.
    """
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    try:
        na, nb = normalize_answer(a), normalize_answer(b)
    except Exception:  # defensive: normalisation is plain string work
        return False
    if not na or not nb:
        return False
    if na == nb:
        return True
    if timeout is not None and timeout <= 0:
        return False
    return symbolic_equal(na, nb, timeout)
