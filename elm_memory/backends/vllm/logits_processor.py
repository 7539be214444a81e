"""vLLM logits processor that ends a sequence once its final ``\\boxed{}`` answer is closed.

Imports vllm at module level: it is loaded *inside* the vLLM engine (offline: passed to
``LLM(logits_processors=[...])``; server: ``--logits-processors
elm_memory.backends.vllm.logits_processor:StopAtAnswerLogitsProcessor``), never by
``import elm_memory``.

Per request it is active only when ``SamplingParams.extra_args["elm_stop_at_answer"]``
holds the token id to end with (an EOS id); the server passes it from the request's
``vllm_xargs``. After each generated token the completion is checked with
:func:`elm_memory.backends.postprocess.answer_closed_after` -- the test of the transformers
backend and of the cut after generation. Once closed, every logit but that EOS id is set to
-inf, so the next token is EOS and the request finishes. The caller strips that EOS and reports
``finish_reason="answer"``. Log-probabilities are unaffected (vLLM's ``raw_logprobs`` are
taken before logits processors).

This is a V1-interface processor: vLLM's V2 model runner refuses it at start-up, so the
backends register it only where :mod:`elm_memory.backends.vllm.model_runner` says V1 will run;
otherwise answers are cut after generation only, with the same result.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from elm_memory.backends.vllm.model_runner import STOP_XARG


class _PerRequest:
    def __init__(self, owner: StopAtAnswerLogitsProcessor, eos_id: int):
        self.owner = owner
        self.eos_id = eos_id
        self.closed = False
        self.checked = 0  # output length at the last check

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.closed and output_ids and len(output_ids) != self.checked:
            self.checked = len(output_ids)
            self.closed = self.owner.answer_closed(output_ids)
        if self.closed:
            forced = torch.full_like(logits, float("-inf"))
            forced[self.eos_id] = 0.0
            return forced
        return logits


class StopAtAnswerLogitsProcessor(AdapterLogitsProcessor):
    """Forces EOS right after the token that closes a non-empty ``\\boxed{...}``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._tokenizer: Any = None
        self._has_brace: dict[int, bool] = {}  # token id -> its text contains "}"

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    def answer_closed(self, output_ids: list[int]) -> bool:
        from elm_memory.backends.postprocess import answer_closed_after

        return answer_closed_after(self.tokenizer, output_ids, output_ids[-1], self._has_brace)

    def is_argmax_invariant(self) -> bool:
        return False  # forcing EOS changes greedy decoding

    def new_req_logits_processor(self, params: Any) -> _PerRequest | None:
        args = params.extra_args or {}
        eos = args.get(STOP_XARG)
        if eos is None or eos is False:
            return None
        return _PerRequest(self, int(eos))
