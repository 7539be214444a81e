"""The default model (Qwen2.5-Coder-0.5B-Instruct, bf16) answers easy questions in \\boxed{}."""

from __future__ import annotations

import pytest

from elm_memory.answers import extract_answer
from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.elm import ELM

pytestmark = pytest.mark.model


def test_stop_at_answer_ends_right_after_the_boxed_answer(default_backend):
    from elm_memory.backends.prompting import PromptBuilder

    p = PromptBuilder(default_backend.tokenizer).build("What is 2+3?")
    assert "<|im_start|>user" in p.text  # the chat template is applied
    params = SamplingParams(max_new_tokens=200, stop_at_answer=True)
    [[g]] = default_backend.generate([PromptInput(p.token_ids)], params)
    assert g.finish_reason in {"answer", "stop"}
    assert extract_answer(g.text) == "5"
    if g.finish_reason == "answer":  # nothing generated after the closing brace but the brace's own token
        assert g.text.rstrip().rstrip("$").rstrip(".").rstrip("\\]").rstrip().endswith("}")


def test_elm_answer_zero_shot_on_the_default_model(default_loaded):
    overrides = {"store": {"kind": "none"}, "learner": {"mode": "off"}, "verifier": {"route": "verify"}}
    cfg = ELMConfig.load(preset="cpu-demo", overrides=overrides)  # verify: the demo's vote would sample too
    elm = ELM(cfg, loaded=default_loaded)
    result = elm.answer("Tom has 3 apples and buys 4 more. How many apples does he have now?")
    assert result.answer == "7", result.response
    assert result.route == "zero_shot" and result.memory_id is None
    assert result.timings["dual_generate"] > 0 and result.learn_job["status"] == "skipped"  # learner.mode=off
