"""vLLM logits processor that ends a sequence once its final ``\\boxed{}`` answer is closed.

Imports vllm at module level: it is loaded *inside* the vLLM engine (offline: passed to
``LLM(logits_processors=[...])``; server: ``--logits-processors
elm_memory.backends._vllm_logits:StopAtAnswerLogitsProcessor``), never by
``import elm_memory``.

Per request it is active only when ``SamplingParams.extra_args["elm_stop_at_answer"]``
holds the token id to end with (an EOS id); the server passes it from the request's
``vllm_xargs``. After a generated token whose text contains ``}``, the completion so far
is decoded (special tokens skipped) and checked with
:func:`elm_memory.answers.is_answer_closed` -- the same test as the transformers
backend's stopping criterion. Once closed, every logit but that EOS id is set to -inf, so
the next token is EOS and the request finishes. The caller strips that EOS and reports
``finish_reason="answer"``. Log-probabilities are unaffected (vLLM's ``raw_logprobs`` are
taken before logits processors).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

XARG = "elm_stop_at_answer"


class _PerRequest:
    def __init__(self, owner: StopAtAnswerLogitsProcessor, eos_id: int):
        self.owner = owner
        self.eos_id = eos_id
        self.closed = False
        self.checked = 0  # output length at the last check

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.closed and output_ids and len(output_ids) != self.checked:
            self.checked = len(output_ids)
            if self.owner.has_brace(output_ids[-1]):
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
        self._brace: list[bool] | None = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    def has_brace(self, token_id: int) -> bool:
        if self._brace is None:
            tok = self.tokenizer
            pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
            self._brace = ["}" in (p or "") for p in pieces]
        return 0 <= token_id < len(self._brace) and self._brace[token_id]

    def answer_closed(self, output_ids: list[int]) -> bool:
        from elm_memory.answers import is_answer_closed

        return is_answer_closed(self.tokenizer.decode(output_ids, skip_special_tokens=True))

    def is_argmax_invariant(self) -> bool:
        return False  # forcing EOS changes greedy decoding

    def new_req_logits_processor(self, params: Any) -> _PerRequest | None:
        args = params.extra_args or {}
        eos = args.get(XARG)
        if eos is None or eos is False:
            return None
        return _PerRequest(self, int(eos))
