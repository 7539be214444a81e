"""``self_certainty``: the policy's own confidence in a response (Kang et al. 2025,
"Scalable Best-of-N Selection for Large Language Models via Self-Certainty").

Per response token t, with p_t the model's next-token distribution over its V logits::

    KL(U || p_t) = sum_v (1/V) log((1/V) / p_t(v)) = -log V - (1/V) sum_v log p_t(v)

and the score is the mean over the response tokens. It is 0 for a uniform distribution
and grows as the distribution peaks: higher = more confident. Training-free and needs no
second model, hence the CPU default. V is the logits' last dimension (the model's output
vocabulary, padding rows included: a constant offset shared by every candidate).

Conditioning, truncation, empty responses and eval/no-grad handling: see
:class:`elm_memory.verifiers.base.PolicyVerifier` (default: both candidates under the same
plain zero-shot prompt).
"""

from __future__ import annotations

import math

import torch

from elm_memory.verifiers.base import PolicyVerifier


class SelfCertaintyVerifier(PolicyVerifier):
    """Mean KL(uniform || p) over the response tokens, teacher-forced through the policy."""

    name = "self_certainty"

    def token_scores(self, logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -math.log(logp.shape[-1]) - logp.mean(dim=-1)
