"""The one-row int4 engine (``backend.one_row_engine``, elm_memory/backends/int4.py): the kernel's product,
the int4 tree beside the shared model, which calls take it, and what it serves on SmolLM2.

Tolerances. In float32 the int4 kernel multiplies by exactly the values its codes stand for, so the int4
tree's logits equal a copy of the model whose linear weights are those values, up to float32 summation
order (1e-4 here). Against the plain loop on the loaded weights the tokens differ in general (4-bit weights;
the default model drifts from token 3 on some prompts: docs/performance.md), but SmolLM2's packaged GGUF is
Q4_1 (groups of 32, scale and minimum from each group's range), the very grid the engine quantizes to, so on
SmolLM2 the engine reproduces the plain loop's logits within 1e-3 and its tokens exactly: what lets the
tests below check that it serves soft prompts, samples and LoRA memories by comparing tokens."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from _fakes import one_thread, tiny_qwen2_config

from elm_memory.backends import int4
from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.hardware import Placement, resolve_one_row_engine
from elm_memory.memory.lora import LoraAdapter, RowLoras
from elm_memory.memory.prefix import question_prefix

GREEDY = SamplingParams(max_new_tokens=16)


def _dequantized_copy(model: Any, *, lm_head: bool = False) -> Any:
    """A deep copy of ``model`` whose quantizable linear weights are the values their int4 codes stand for."""
    ref = copy.deepcopy(model)
    head = ref.get_output_embeddings()
    for module in ref.modules():
        if isinstance(module, torch.nn.Linear) and (lm_head or module is not head) and int4.quantizable(module, 32):
            _, _, values = int4.quantize(module.weight.detach(), 32, values=True)
            assert values is not None
            module.weight = torch.nn.Parameter(values, requires_grad=False)
    return ref


# -- no model ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int4_linear_multiplies_by_the_values_its_codes_stand_for(dtype, atol):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True).to(dtype).requires_grad_(False)
    q = int4.Int4Linear(linear)
    assert q.weight is linear.weight and q.bias is linear.bias  # shared, not copied
    _, _, values = int4.quantize(linear.weight, 32, values=True)
    x = torch.randn(2, int4.INT4_MAX_TOKENS // 2, 128).to(dtype)  # a decode step's few tokens
    with torch.no_grad():
        expected = torch.nn.functional.linear(x.float(), values.float(), linear.bias.float())
        assert torch.allclose(q(x).float(), expected, atol=atol)
        assert (values.float() - linear.weight.float()).abs().max() > 1e-3  # 4 bits: not the weights themselves
        prefill = torch.randn(1, int4.INT4_MAX_TOKENS + 1, 128).to(dtype)  # more tokens: the layer's own product
        assert torch.equal(q(prefill), linear(prefill))
    x.requires_grad_(True)  # so does a forward that builds a graph
    assert torch.equal(q(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


def test_a_merged_lora_linear_multiplies_by_the_merged_weights_codes_and_its_prefill_adds_the_delta():
    torch.manual_seed(1)
    linear = torch.nn.Linear(128, 48, bias=False).requires_grad_(False)
    a, b = torch.randn(4, 128) * 0.1, torch.randn(48, 4) * 0.1
    q = int4.LoraInt4Linear(linear, a, b, 2.0, 32)
    assert q.weight is linear.weight  # the bf16 weight is still the model's own
    merged = linear.weight + 2.0 * b @ a
    _, _, values = int4.quantize(merged, 32, values=True)
    x = torch.randn(1, int4.INT4_MAX_TOKENS, 128)
    prefill = torch.randn(1, int4.INT4_MAX_TOKENS + 3, 128)
    with torch.no_grad():
        assert torch.allclose(q(x), torch.nn.functional.linear(x, values), atol=1e-5)
        assert torch.allclose(q(prefill), torch.nn.functional.linear(prefill, merged), atol=1e-5)
        unmerged = int4.Int4Linear(linear)(x)
        assert (q(x) - unmerged).abs().max() > 1e-2  # the delta is in the codes, not rounded away


def test_only_layers_the_kernel_takes_are_quantized():
    assert int4.quantizable(torch.nn.Linear(64, 32), 32)
    assert not int4.quantizable(torch.nn.Linear(48, 32), 32)  # in_features not a multiple of the group
    assert not int4.quantizable(torch.nn.Linear(64, 24), 32)  # out_features not a multiple of 16


@pytest.fixture(scope="module")
def random_qwen():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(96, 64)).eval().requires_grad_(False)


def test_the_int4_tree_is_the_model_with_int4_linears_and_shares_the_rest(random_qwen):
    model = random_qwen
    tree = int4.int4_model(model)
    assert int4.int4_model(model) is tree  # made once per model
    assert tree is not model and tree.model.embed_tokens is model.model.embed_tokens
    assert tree.model.norm is model.model.norm and tree.lm_head is model.lm_head  # the output layer kept
    layer, original = tree.model.layers[0], model.model.layers[0]
    assert layer is not original and layer.input_layernorm is original.input_layernorm
    assert (
        isinstance(layer.mlp.down_proj, int4.Int4Linear) and layer.mlp.down_proj.weight is original.mlp.down_proj.weight
    )
    assert not any(isinstance(m, int4.Int4Linear) for m in model.modules())  # the shared model is unchanged
    assert sum(isinstance(m, int4.Int4Linear) for m in tree.modules()) == 2 * 7
    ids = torch.tensor([[5, 17, 3, 44, 9, 60, 2]])
    with torch.no_grad():
        got = tree(input_ids=ids).logits
        assert torch.allclose(got, _dequantized_copy(model)(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(got, model(input_ids=ids).logits, atol=1e-3)  # random weights: 4 bits show
    head = int4.int4_model(model, lm_head=True)
    assert isinstance(head.lm_head, int4.Int4Linear) and head is not tree


@pytest.mark.parametrize(
    "requested, device, dtype, engine, why",
    [
        ("plain", "cpu", "bfloat16", "plain", "backend.one_row_engine: plain"),
        ("auto", "cpu", "bfloat16", "int4", "auto: a CPU in bf16"),
        ("auto", "cpu", "float32", "plain", "measured against a bf16 loop only"),
        ("int4", "cpu", "float32", "int4", "backend.one_row_engine: int4"),
        ("int4", "cuda", "bfloat16", "plain", "CPU kernels"),
        ("auto", "cuda", "bfloat16", "plain", "CPU kernels"),
    ],
)
def test_the_engine_follows_the_setting_device_and_dtype(requested, device, dtype, engine, why):
    got, reason = resolve_one_row_engine(requested, Placement(device=device, dtype=dtype, num_threads=2))
    assert got == engine and why in reason


@pytest.mark.parametrize(
    "requested, llama_missing, engine, why",
    [
        ("llama", None, "llama", "backend.one_row_engine: llama"),
        ("llama", "llama_cpp does not import", "plain", "but llama_cpp does not import"),
        ("auto", None, "llama", "auto: llama.cpp on the model's GGUF"),
        ("auto", "no GGUF", "int4", "(llama.cpp: no GGUF)"),
        ("int4", None, "int4", "backend.one_row_engine: int4"),  # asked for int4: int4, llama or not
    ],
)
def test_llama_is_taken_where_it_can_serve_and_auto_prefers_it(requested, llama_missing, engine, why):
    cpu = Placement(device="cpu", dtype="bfloat16", num_threads=2)
    got, reason = resolve_one_row_engine(requested, cpu, llama_missing=llama_missing)
    assert got == engine and why in reason
    gpu = Placement(device="cuda", dtype="bfloat16", num_threads=2)
    assert resolve_one_row_engine(requested, gpu, llama_missing=None)[0] == "plain"


def test_other_backends_and_the_generate_loop_keep_their_own_decoding():
    cpu = Placement(device="cpu", dtype="bfloat16", num_threads=2)
    assert resolve_one_row_engine("int4", cpu, backend="vllm")[0] == "plain"
    engine, why = resolve_one_row_engine("int4", cpu, decode_loop="generate")
    assert engine == "plain" and "decode_loop=generate" in why


def test_the_setting_is_checked_and_elm_env_names_the_engine():
    from elm_memory.config import ELMConfig
    from elm_memory.environment import collect_env, format_env
    from elm_memory.errors import ConfigError

    assert ELMConfig.load().backend.one_row_engine == "plain"  # until the quality check and a quiet benchmark
    with pytest.raises(ConfigError):
        ELMConfig.load(overrides={"backend": {"one_row_engine": "int8"}})
    cfg = ELMConfig.load(overrides={"backend": {"one_row_engine": "int4"}, "model": {"device": "cpu"}})
    report = collect_env(cfg)
    assert report["resolved"]["one_row_engine"] == "int4"
    assert "one-row engine  int4 (backend.one_row_engine: int4" in format_env(report)


# -- SmolLM2 -----------------------------------------------------------------------------------------------


def test_a_lora_merged_tree_shares_the_untargeted_layers_and_is_found_again_by_content(random_qwen):
    model = random_qwen
    start = LoraAdapter.initial(model, rank=4, alpha=8, seed=3, targets=("q_proj", "down_proj"))
    gen = torch.Generator().manual_seed(3)
    lora = LoraAdapter({n: (a, torch.randn(b.shape, generator=gen) * 0.05) for n, (a, b) in start.weights.items()}, 8)
    tree = int4.int4_lora_model(model, lora)
    assert tree is not None and int4.int4_lora_model(model, lora.detached()) is tree  # a copy: the same tree
    base = int4.int4_model(model)
    layer, base_layer = tree.model.layers[1], base.model.layers[1]
    assert isinstance(layer.self_attn.q_proj, int4.LoraInt4Linear) and isinstance(
        layer.mlp.down_proj, int4.LoraInt4Linear
    )
    assert layer.self_attn.k_proj is base_layer.self_attn.k_proj  # untargeted: the base tree's int4 layer
    assert not any(isinstance(m, int4.LoraInt4Linear) for m in base.modules())
    merged_copy = copy.deepcopy(model)  # the model with the LoRA folded into its weights, then int4's values
    for name, (a, b) in lora.weights.items():
        merged_copy.get_submodule(name).weight += lora.scale * b @ a
    ids = torch.tensor([[5, 17, 3, 44, 9, 60, 2]])  # few tokens: the int4 product everywhere
    long_ids = torch.arange(1, 20).unsqueeze(0)  # a prefill: the dense product plus the delta
    with torch.no_grad():
        assert torch.allclose(
            tree(input_ids=ids).logits, _dequantized_copy(merged_copy)(input_ids=ids).logits, atol=1e-4
        )
        with lora.apply(model, 1):
            hooked = model(input_ids=long_ids).logits
        assert torch.allclose(tree(input_ids=long_ids).logits, hooked, atol=1e-4)
    other = LoraAdapter({n: (a, b * 2) for n, (a, b) in lora.weights.items()}, 8)
    assert int4.int4_lora_model(model, other) is not tree  # other tensors: another tree (the newest is kept)


@pytest.fixture(scope="module")
def backends(tiny_loaded):
    """The plain backend and an int4 one on the same SmolLM2 (float32), on one thread."""
    from elm_memory.backends.hf import HFBackend

    with one_thread():
        yield HFBackend(tiny_loaded), HFBackend(tiny_loaded, one_row_engine="int4")


@pytest.fixture(scope="module")
def prompts(tiny_loaded):
    pb = PromptBuilder(tiny_loaded.tokenizer)
    return pb.build("What is 2+3?"), pb.build("Tom has 3 apples and buys 4 more. How many apples does he have?")


def _tokens(backend, inputs, params=GREEDY, engine="int4"):
    before = backend.engine_calls[engine]
    out = [[g.token_ids for g in gens] for gens in backend.generate(inputs, params)]
    assert backend.engine_calls[engine] == before + 1, f"the call did not take the {engine} engine"
    return out


@pytest.mark.model
def test_on_smollm2_int4_keeps_the_plain_loops_logits_and_tokens(backends, tiny_loaded, prompts):
    plain, q4 = backends
    ids = torch.tensor([prompts[1].token_ids[-int4.INT4_MAX_TOKENS :]])  # few tokens: the int4 product
    with torch.no_grad():
        ref = torch.log_softmax(tiny_loaded.model(input_ids=ids).logits[0, -1], -1)
        got = torch.log_softmax(int4.int4_model(tiny_loaded.model)(input_ids=ids).logits[0, -1], -1)
    assert 0 < (ref - got).abs().max() < 1e-3  # Q4_1's grid requantized (module docstring)
    both = [PromptInput(p.token_ids) for p in prompts]
    assert _tokens(q4, both) == _tokens(plain, both, engine="plain")


@pytest.mark.model
def test_int4_serves_soft_prompts_seeded_samples_and_the_answer_stop(backends, tiny_loaded, prompts):
    plain, q4 = backends
    gen = torch.Generator().manual_seed(0)
    table = tiny_loaded.model.get_input_embeddings().weight
    soft = table[torch.tensor([40, 41, 42, 43, 44])].float() + torch.randn(5, table.shape[1], generator=gen) * 0.01
    p = prompts[0]
    inputs = [PromptInput(p.token_ids, soft_prompt=soft, soft_prompt_at=p.user_turn_at)]
    assert _tokens(q4, inputs) == _tokens(plain, inputs, engine="plain")
    assert _tokens(q4, inputs) != _tokens(q4, [PromptInput(p.token_ids)])  # the soft prompt reached the model
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, n=2, stop_at_answer=True)
    drawn = _tokens(q4, inputs, sampled)
    assert drawn == _tokens(plain, inputs, sampled, engine="plain") and drawn == _tokens(q4, inputs, sampled)
    assert drawn[0][0] != drawn[0][1]  # two rows, two draws


def _lora(model, seed: int) -> LoraAdapter:
    start = LoraAdapter.initial(model, rank=4, alpha=8, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return LoraAdapter({n: (a, torch.randn(b.shape, generator=gen) * 0.05) for n, (a, b) in start.weights.items()}, 8)


@pytest.mark.model
def test_int4_decodes_a_lora_memory_merged_into_its_int4_layers(backends, tiny_loaded, prompts):
    plain, q4 = backends
    lora = _lora(tiny_loaded.model, 1)
    inputs = [PromptInput(prompts[1].token_ids, memory=lora)]
    merged_before = q4.engine_calls["int4_lora_merged"]
    under = _tokens(q4, inputs)
    assert q4.engine_calls["int4_lora_merged"] == merged_before + 1
    assert under != _tokens(q4, [PromptInput(prompts[1].token_ids)])  # the delta was applied
    # W + delta requantized is not SmolLM2's Q4_1 grid, so later tokens may part from the plain loop's; the
    # prefill is the dense product plus the delta, so the first token and the prompt's logits are the plain loop's
    ref = _tokens(plain, inputs, engine="plain")[0][0]
    assert under[0][0][0] == ref[0]
    tree = int4.int4_lora_model(tiny_loaded.model, lora)
    assert tree is not None
    ids = torch.tensor([list(prompts[1].token_ids) + ref])
    with torch.no_grad():
        with lora.apply(tiny_loaded.model, 1):
            expected = tiny_loaded.model(input_ids=ids).logits
        assert torch.allclose(tree(input_ids=ids).logits, expected, atol=1e-4)
    for model in (tiny_loaded.model, int4.int4_model(tiny_loaded.model), tree):  # no hook was left behind
        assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.model
def test_a_fused_call_serves_each_prompts_own_lora(backends, tiny_loaded, prompts):
    plain, q4 = backends
    lora = _lora(tiny_loaded.model, 2)
    requests = [
        ([PromptInput(prompts[0].token_ids, memory=lora)], GREEDY),
        ([PromptInput(prompts[1].token_ids)], GREEDY),
    ]
    before = q4.engine_calls["int4"]
    got = q4.generate_many(requests)  # two rows, one batch: RowLoras puts the delta on the first only
    assert q4.engine_calls["int4"] == before + 1
    assert [[g.token_ids for g in gens] for r in got for gens in r] == [
        [g.token_ids for g in gens] for r in plain.generate_many(requests) for gens in r
    ]
    assert q4.decode_engine(2, RowLoras([lora, None])) == "int4"


@pytest.mark.model
def test_two_rows_take_int4_and_more_take_the_plain_loop(backends, prompts):
    _, q4 = backends
    one, two = (PromptInput(p.token_ids) for p in prompts)
    short = SamplingParams(max_new_tokens=2)
    _tokens(q4, [one], short)  # one row
    _tokens(q4, [one, two], short)  # two prompts, a row each
    _tokens(q4, [one], SamplingParams(max_new_tokens=2, temperature=1.0, seed=1, n=2))  # one prompt, two samples
    _tokens(q4, [one], SamplingParams(max_new_tokens=2, temperature=1.0, seed=1, n=3), engine="plain")
    _tokens(q4, [one, two, one], short, engine="plain")
    assert [q4.decode_engine(rows) for rows in (1, 2, 3, 8)] == ["int4", "int4", "plain", "plain"]


@pytest.mark.model
def test_a_prefix_memory_takes_the_plain_loop_with_one_log_line(backends, tiny_loaded, prompts, caplog):
    _, q4 = backends
    q = tuple(tiny_loaded.tokenizer("Tom has 3 apples.", add_special_tokens=False)["input_ids"])
    prefix = question_prefix(tiny_loaded, q, len(q))
    inputs = [PromptInput(prompts[0].token_ids, memory=prefix)]
    with caplog.at_level(logging.INFO, logger="elm_memory.backends.hf"):
        _tokens(q4, inputs, SamplingParams(max_new_tokens=2), engine="plain")
        _tokens(q4, inputs, SamplingParams(max_new_tokens=2), engine="plain")
    lines = [r.getMessage() for r in caplog.records if "prefix memory takes the plain loop" in r.getMessage()]
    assert len(lines) == 1 and "one_row_engine int4" in lines[0]


@pytest.mark.model
def test_int4_serves_lookup_drafts(tiny_loaded, prompts):
    from elm_memory.backends.hf import HFBackend

    inputs = [PromptInput(prompts[1].token_ids)]
    with one_thread():
        plain = HFBackend(tiny_loaded, lookup_draft_tokens=3)
        q4 = HFBackend(tiny_loaded, lookup_draft_tokens=3, one_row_engine="int4")
        assert _tokens(q4, inputs) == _tokens(plain, inputs, engine="plain")
