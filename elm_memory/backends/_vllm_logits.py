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

This is a V1-interface processor: vLLM's V2 model runner (the GPU default in recent
releases) refuses it at start-up, so the backends register it only when vLLM's engine
config says the V1 runner will run (:func:`server_uses_v2_model_runner` below for a
server's command line, :func:`elm_memory.backends.vllm.uses_v2_model_runner` offline);
otherwise answers are cut after generation only, with the same result.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from elm_memory.backends.vllm import PROBE_ERROR_MARK, RUNNER_MARK, VERSION_MARK

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


# ---- which model runner a server command line gets (run in the server's own Python) ----


def server_uses_v2_model_runner(argv: list[str]) -> bool:
    """vLLM's runner decision for a server started with the engine flags in ``argv`` (other
    flags are ignored): the engine config is built from them and ``use_v2_model_runner`` read."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM releases before the utils split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    from vllm.engine.arg_utils import AsyncEngineArgs

    from elm_memory.backends.vllm import v2_runner_from_engine_config

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args, _ = parser.parse_known_args(argv)
    args.logits_processors = None  # the decision is made without ours, as the offline check does
    return v2_runner_from_engine_config(AsyncEngineArgs.from_cli_args(args).create_engine_config())


if __name__ == "__main__":
    # vLLM logs to stdout too: the answers are the lines that start with the marks.
    import vllm

    print(VERSION_MARK + str(vllm.__version__), flush=True)
    try:
        v2 = server_uses_v2_model_runner(sys.argv[1:])
    except Exception as exc:  # e.g. V2 forced where vLLM refuses it: the engine would not start either
        print(PROBE_ERROR_MARK + f"{type(exc).__name__}: " + " ".join(str(exc).split())[:400], flush=True)
        sys.exit(1)
    print(RUNNER_MARK + ("v2" if v2 else "v1"), flush=True)
