"""Frozen linear weights prepacked for oneDNN (``elm_memory/models/prepack.py``) give the plain
model's logits and decoded tokens up to rounding (not bit for bit: at some row counts oneDNN blocks the
sum differently with a packed weight), leave training forwards to ``F.linear``, and fall back to it
wherever the packed copy could be stale or cannot run."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from _fakes import tiny_qwen2_config

from elm_memory.backends.base import PromptInput
from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.models.prepack import PackedLinear, prepack_available, prepack_linears, unpack_linears

pytestmark = pytest.mark.skipif(
    not prepack_available(torch.bfloat16), reason="no oneDNN packed linear ops in bf16 on this torch build or CPU"
)

VOCAB = 512


def _model(dtype=torch.bfloat16):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_qwen2_config(VOCAB, 256)
    return Qwen2ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair():
    plain, packed = _model(), _model()
    assert prepack_linears(packed) == 2 * 7 + 1  # q k v o gate up down per layer, and the lm_head
    return plain, packed


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Relative to the whole tensor: a last-bit difference in bf16 passes, a wrong or stale weight does not."""
    return bool(((a.float() - b.float()).norm() / b.float().norm()) < tol)


@pytest.mark.parametrize("rows", [1, 8, 70])
def test_logits_are_the_plain_models_up_to_rounding(pair, rows):
    plain, packed = pair
    ids = torch.randint(0, VOCAB, (rows, 9), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        assert _close(packed(input_ids=ids).logits, plain(input_ids=ids).logits, 1e-2)


def test_greedy_and_seeded_tokens_are_the_plain_models_in_float32():
    plain, packed = _model(torch.float32), _model(torch.float32)
    assert prepack_linears(packed) == 15
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for options in (DecodeOptions(max_new_tokens=12), DecodeOptions(max_new_tokens=12, temperature=0.9, n=4)):
        outs = []
        for model in (plain, packed):
            gens = [torch.Generator().manual_seed(i) for i in range(3)]
            outs.append(sample(model, mask, options, input_ids=ids, generators=gens))
        assert outs[0] == outs[1] and len(outs[0]) == 3 * options.n


def test_a_soft_prompts_log_probs_and_gradient_are_the_plain_models(pair):
    results = []
    for model in pair:
        soft = (0.05 * torch.randn(4, 64, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
        soft.requires_grad_(True)
        prompt = PromptInput((20, 21, 22, 23), soft_prompt=soft, soft_prompt_at=0)
        lp, mask = completion_logprobs(model, [prompt], [[5, 6, 7], [8, 9]], temperature=0.7)
        (lp * mask).sum().backward()
        results.append((lp.detach(), soft.grad))
    # a forward that builds a graph runs F.linear: training is the plain model's, bit for bit
    assert torch.equal(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1]) and results[0][1].abs().sum() > 0


def test_hooks_and_isinstance_see_the_module_they_saw_before(pair):
    _, packed = pair
    layer = packed.model.layers[0].mlp.up_proj
    assert isinstance(layer, torch.nn.Linear) and type(layer) is PackedLinear
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    handle = layer.register_forward_hook(lambda _m, _i, out: out + 1)
    try:
        assert torch.equal(layer(x), F.linear(x, layer.weight) + 1)
    finally:
        handle.remove()


def test_a_replaced_or_trainable_weight_is_never_read_from_the_stale_copy():
    model = _model()
    prepack_linears(model)
    layer = model.model.layers[1].self_attn.o_proj
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(2 * layer.weight.detach(), requires_grad=False)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    layer.weight.requires_grad_(True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_a_compiled_forward_traces_the_plain_linear():
    """Under torch.compile a packed layer is F.linear (the compiler cannot trace the stale-copy check), so
    captured decode steps compile on a prepacked CPU model."""
    layer = _model().model.layers[0].mlp.down_proj
    prepack_linears(layer)
    assert isinstance(layer, PackedLinear)
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), F.linear(x, layer.weight))


def test_copies_and_pickles_run_plain_and_unpack_restores_the_class(pair):
    _, packed = pair
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = packed(input_ids=ids).logits
        assert torch.equal(copy.deepcopy(packed)(input_ids=ids).logits, want)
        assert torch.equal(pickle.loads(pickle.dumps(packed))(input_ids=ids).logits, want)
    other = _model()
    prepack_linears(other)
    assert unpack_linears(other) == 15 and not any(type(m) is PackedLinear for m in other.modules())


def test_float32_logits_are_close_and_loading_follows_the_placement(tiny_loaded):
    model = _model(torch.float32)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert prepack_linears(model) == 15
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    # the float32 fixture: auto leaves its weights plain
    assert not tiny_loaded.placement.weight_prepack
    assert not any(type(m) is PackedLinear for m in tiny_loaded.model.modules())
