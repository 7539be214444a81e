"""``logprob``: mean log-probability of the response tokens under the policy model
(teacher-forced, temperature 1). Higher = the model finds the response more likely.

Conditioning, truncation, empty responses and eval/no-grad handling: see
:class:`elm_memory.verifiers.base.PolicyVerifier` (default: both candidates under the same
plain zero-shot prompt).
"""

from __future__ import annotations

import torch

from elm_memory.verifiers.base import PolicyVerifier


class LogprobVerifier(PolicyVerifier):
    """Mean log p(response token | prompt, previous response tokens)."""

    name = "logprob"

    def token_scores(self, logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logp.gather(1, targets.unsqueeze(1)).squeeze(1)
