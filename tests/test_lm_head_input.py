"""The lm_head always gets a dense slice of the hidden states (elm_memory/models/logits.py).

A strided slice (``logits_to_keep`` as a count) makes torch.matmul copy the whole lm_head weight
once per row; these tests watch the lm_head's input on every path that keeps only some positions."""

from __future__ import annotations

import pytest
import torch

from elm_memory.backends import decode
from elm_memory.backends.base import PromptInput
from elm_memory.models import teacher_forcing
from elm_memory.models.logits import last_positions

pytestmark = pytest.mark.model


@pytest.fixture
def lm_head_inputs(smol):
    """Shapes and strides of every tensor the lm_head receives while the test runs."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    head = smol.model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append((tuple(args[0].shape), args[0].stride())))
    yield seen
    handle.remove()


def _dense(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape).stride()


def test_last_positions():
    assert last_positions(1, 5).tolist() == [4]
    assert last_positions(3, 5).tolist() == [2, 3, 4]
    assert last_positions(9, 2).tolist() == [0, 1]


def test_a_decode_prefill_hands_the_lm_head_a_dense_last_position(smol, lm_head_inputs):
    tok = smol.tokenizer
    a, b = tok("Two plus two is")["input_ids"], tok("The capital of France, a country in Europe, is")["input_ids"]
    width = max(len(a), len(b))
    ids = torch.tensor([[0] * (width - len(a)) + a, [0] * (width - len(b)) + b])
    mask = torch.tensor([[0] * (width - len(a)) + [1] * len(a), [0] * (width - len(b)) + [1] * len(b)])
    decode.sample(smol.model, mask, decode.DecodeOptions(max_new_tokens=2), input_ids=ids)
    prefill = lm_head_inputs[0]
    assert prefill[0] == (2, 1, smol.model.config.hidden_size)  # only the last position reaches the lm_head
    assert all(stride == _dense(shape) for shape, stride in lm_head_inputs)


@pytest.mark.parametrize("share_prompt_kv", [False, True])
def test_teacher_forcing_hands_the_lm_head_dense_completion_positions(smol, lm_head_inputs, share_prompt_kv):
    prompt = PromptInput(tuple(smol.tokenizer("What is 3 + 4? Answer:")["input_ids"]))
    completions = [[220, 22, 13], [220, 23]]
    logits, _, _ = teacher_forcing.completion_logits(smol.model, [prompt], completions, share_prompt_kv=share_prompt_kv)
    assert logits.shape[:2] == (2, 3) and lm_head_inputs
    assert all(stride == _dense(shape) for shape, stride in lm_head_inputs)
    assert all(shape[1] < len(prompt.token_ids) + 3 for shape, _ in lm_head_inputs)  # never every position


def test_prefix_encoders_hand_the_lm_head_only_a_dense_last_position(smol, lm_head_inputs):
    from elm_memory.backends.kv_prefix import encode_prefix
    from elm_memory.memory.prefix import question_prefix

    ids = smol.tokenizer("Anna has 3 apples and buys 4 more. How many apples does she have?")["input_ids"]
    encode_prefix(smol.model, ids)
    question_prefix(smol, ids, k=4)
    assert [shape[1] for shape, _ in lm_head_inputs] == [1, 1]
    assert all(stride == _dense(shape) for shape, stride in lm_head_inputs)
