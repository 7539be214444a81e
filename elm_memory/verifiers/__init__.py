"""Verifiers: score the zero-shot and the memory answer when they disagree; higher wins.

>>> verifier = build_verifier(cfg, backend)          # cfg.verifier.name picks it
>>> verifier.score(question, [Candidate(text, ids, prompt), ...])

Built-ins: ``prm`` (process reward model, own model), ``self_certainty`` and ``logprob``
(the policy model through the backend), ``consistency`` (agreement with fresh samples).
Plugins: entry-point group ``elm_memory.verifiers``.
Importing this package does not import torch.
"""

from elm_memory.verifiers.base import EMPTY_SCORE, Candidate, PolicyVerifier, Verifier, build_verifier

__all__ = ["EMPTY_SCORE", "Candidate", "PolicyVerifier", "Verifier", "build_verifier"]
