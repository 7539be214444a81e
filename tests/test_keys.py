"""Key builders: shapes, hook hygiene, and the KV key against an independent computation."""

from __future__ import annotations

import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from _fakes import tiny_qwen2_config

from elm_memory.errors import ConfigError, MemoryFormatError
from elm_memory.memory.keys import (
    InputKeyBuilder,
    KeyBuilder,
    KVCenteredKeyBuilder,
    KVKeyBuilder,
    SoftPromptMeanKeyBuilder,
    attention_modules,
    key_builders,
)
from elm_memory.models.fingerprint import embedding_fingerprint
from elm_memory.models.loading import LoadedModel, ModelInfo
from elm_memory.retrieval import keys as keys_mod

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def random_tiny_model(seed: int = 0) -> LoadedModel:
    """A randomly initialised 2-layer Qwen2 with grouped-query attention (4 heads, 2 KV heads)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen2_config(100, 256)
    model = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    info = ModelInfo(
        name="tiny-qwen2",
        path="",
        model_type="qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        max_context=256,
        dtype="float32",
        device="cpu",
        fingerprint=embedding_fingerprint(model),
    )
    return LoadedModel(model=model, tokenizer=None, info=info, load_seconds=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return random_tiny_model()


def reference_kv(loaded: LoadedModel, proj: str, **inputs) -> torch.Tensor:
    """Per-layer pooled projections WITHOUT hooks: layer input = hidden_states[l] -> input_layernorm -> proj.

    Returns (batch, L, head_dim), unnormalised, float64.
    """
    info = loaded.info
    n_heads = info.num_attention_heads if proj == "q_proj" else info.num_key_value_heads
    with torch.no_grad():
        out = loaded.model(**inputs, output_hidden_states=True, use_cache=False)
    per_layer = []
    for li, layer in enumerate(loaded.model.model.layers):
        x = layer.input_layernorm(out.hidden_states[li])
        y = getattr(layer.self_attn, proj)(x).double()
        b, t, _ = y.shape
        per_layer.append(y.view(b, t, n_heads, info.head_dim).mean(dim=(1, 2)))
    return torch.stack(per_layer, dim=1)


def mean_layer_cos(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Paper score: (1/L) sum_l cos(q_l, k_l); q (L, hd), k (N, L, hd) -> (N,)."""
    return F.cosine_similarity(q[None], k, dim=-1).mean(dim=-1)


# ---- registry and protocol ------------------------------------------------------------


def test_registry_and_protocol() -> None:
    for name, cls in (
        ("input", InputKeyBuilder),
        ("soft_prompt_mean", SoftPromptMeanKeyBuilder),
        ("kv", KVKeyBuilder),
        ("kv_centered", KVCenteredKeyBuilder),
    ):
        builder = key_builders.get(name)()
        assert isinstance(builder, cls) and isinstance(builder, KeyBuilder) and builder.kind == name


# ---- tiny model: plumbing ----------------------------------------------------------------


def test_dims_on_tiny_gqa_model(tiny: LoadedModel) -> None:
    ids = [5, 6, 7, 8]
    sp = torch.randn(3, 64)
    for builder, dim in ((InputKeyBuilder(), 64), (SoftPromptMeanKeyBuilder(), 64), (KVKeyBuilder(), 2 * 16)):
        assert builder.dim(tiny.info) == dim
        q, m = builder.query_key(tiny, ids), builder.memory_key(tiny, sp, ids)
        assert q.shape == m.shape == (dim,) and q.dtype == m.dtype == torch.float32
        assert not q.requires_grad and not m.requires_grad


def test_input_and_soft_prompt_mean_definitions(tiny: LoadedModel) -> None:
    ids = [3, 9, 9, 41]
    emb = tiny.model.get_input_embeddings().weight
    expect = emb[torch.tensor(ids)].mean(0)
    assert torch.allclose(InputKeyBuilder().query_key(tiny, ids), expect)
    assert torch.allclose(InputKeyBuilder().memory_key(tiny, torch.randn(5, 64), ids), expect)
    sp = torch.randn(5, 64)
    assert torch.allclose(SoftPromptMeanKeyBuilder().memory_key(tiny, sp, ids), sp.mean(0))
    assert torch.allclose(SoftPromptMeanKeyBuilder().query_key(tiny, ids), expect)
    with pytest.raises(MemoryFormatError):
        SoftPromptMeanKeyBuilder().memory_key(tiny, torch.randn(5, 63), ids)
    with pytest.raises(ConfigError, match="empty"):
        InputKeyBuilder().query_key(tiny, [])


def test_kv_matches_independent_computation_tiny(tiny: LoadedModel) -> None:
    ids = torch.tensor([[1, 2, 3, 50, 60, 70, 7]])
    sps = torch.randn(4, 6, 64)
    builder = KVKeyBuilder()
    q_ref = reference_kv(tiny, "q_proj", input_ids=ids)[0]
    k_ref = reference_kv(tiny, "k_proj", inputs_embeds=sps)
    q = builder.query_key(tiny, ids[0])
    m = builder.memory_keys(tiny, list(sps), [[1]] * 4)
    assert torch.allclose(q.view(2, 16).double(), F.normalize(q_ref, dim=-1), atol=1e-5)
    assert torch.allclose(m.view(4, 2, 16).double(), F.normalize(k_ref, dim=-1), atol=1e-5)
    # concatenation of unit per-layer vectors: cosine == mean over layers of cosines
    assert torch.allclose(q.norm(), torch.tensor(2.0**0.5), atol=1e-5)
    cos_concat = F.cosine_similarity(q.double()[None], m.double(), dim=-1)
    assert torch.allclose(cos_concat, mean_layer_cos(q_ref, k_ref), atol=1e-6)


def test_kv_batch_equals_single_and_groups_lengths(tiny: LoadedModel) -> None:
    builder = KVKeyBuilder()
    sps = [torch.randn(5, 64), torch.randn(3, 64), torch.randn(5, 64)]
    batch = builder.memory_keys(tiny, sps, [[1]] * 3)
    singles = torch.stack([builder.memory_key(tiny, sp, [1]) for sp in sps])
    assert torch.allclose(batch, singles, atol=1e-5)


def _hook_count(loaded: LoadedModel) -> int:
    return sum(len(a.q_proj._forward_hooks) + len(a.k_proj._forward_hooks) for a in attention_modules(loaded.model))


def test_kv_hooks_removed_even_on_failure(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    KVKeyBuilder().query_key(tiny, [1, 2, 3])
    assert _hook_count(tiny) == 0

    def boom(model):
        def run(**kwargs):
            assert _hook_count(tiny) == tiny.info.num_layers  # one q_proj hook per layer while running
            raise RuntimeError("forward failed")

        return run

    monkeypatch.setattr(keys_mod, "_decoder", boom)
    with pytest.raises(RuntimeError, match="forward failed"):
        KVKeyBuilder().query_key(tiny, [1, 2, 3])
    assert _hook_count(tiny) == 0


def test_kv_refuses_model_without_separate_projections() -> None:
    class NoAttn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 64)

        def get_input_embeddings(self):
            return self.emb

    loaded = LoadedModel(model=NoAttn(), tokenizer=None, info=random_tiny_model().info, load_seconds=0)
    with pytest.raises(ConfigError, match="retrieval.key=input"):
        KVKeyBuilder().query_key(loaded, [1, 2])


# ---- real model (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64) ------------------


def test_real_model_kv_against_independent_computation(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    questions = ["What is 17 + 25?", "A train travels 60 miles in 1.5 hours. What is its speed?"]
    builder = KVKeyBuilder()
    assert builder.dim(smol.info) == 30 * 64
    emb = smol.model.get_input_embeddings().weight
    sps = torch.stack([emb[torch.arange(100, 120)], emb[torch.arange(2000, 2020)], torch.randn(20, 576) * 0.05])
    m = builder.memory_keys(smol, list(sps), [[1]] * 3)
    k_ref = reference_kv(smol, "k_proj", inputs_embeds=sps)
    assert torch.allclose(m.view(3, 30, 64).double(), F.normalize(k_ref, dim=-1), atol=1e-4)
    for text in questions:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        q = builder.query_key(smol, ids)
        q_ref = reference_kv(smol, "q_proj", input_ids=torch.tensor([ids]))[0]
        assert torch.allclose(q.view(30, 64).double(), F.normalize(q_ref, dim=-1), atol=1e-4)
        score = F.cosine_similarity(q.double()[None], m.double(), dim=-1)
        assert torch.allclose(score, mean_layer_cos(q_ref, k_ref), atol=1e-5)
    assert _hook_count(smol) == 0


def test_real_model_input_keys_identify_their_question(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    questions = [
        "Janet has 3 apples and buys 5 more. How many apples does she have?",
        "Find the derivative of x^3 + 2x with respect to x.",
        "What is the capital of France?",
        "Solve for x: 2x + 6 = 14.",
    ]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    emb = smol.model.get_input_embeddings().weight.detach()
    # paper init: the question's own embeddings, tiled to k=20
    sps = [emb[torch.tensor(i).repeat(20)[:20]] for i in ids]
    for builder in (InputKeyBuilder(), SoftPromptMeanKeyBuilder()):
        mem = builder.memory_keys(smol, sps, ids)
        qry = torch.stack([builder.query_key(smol, i) for i in ids])
        sim = F.normalize(qry, dim=-1) @ F.normalize(mem, dim=-1).T
        assert sim.argmax(dim=1).tolist() == [0, 1, 2, 3], builder.kind
    assert torch.allclose(InputKeyBuilder().query_key(smol, ids[0]), InputKeyBuilder().memory_key(smol, sps[0], ids[0]))


# ---- centred KV keys ----------------------------------------------------------------------


def test_kv_centered_removes_each_sides_mean_per_layer(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against an independent computation, with the calibration means given (the random model has no tokenizer)."""
    g = torch.Generator().manual_seed(3)
    centre_q, centre_m = torch.randn(2, 16, generator=g) * 0.3, torch.randn(2, 16, generator=g) * 0.3
    monkeypatch.setitem(keys_mod._centres, tiny.model, (centre_q, centre_m))
    ids = torch.tensor([[1, 2, 3, 50, 60, 70, 7]])
    sps = torch.randn(3, 6, 64, generator=g)
    builder = KVCenteredKeyBuilder()
    q = builder.query_key(tiny, ids[0])
    m = builder.memory_keys(tiny, list(sps), [[1]] * 3)
    q_ref = F.normalize(F.normalize(reference_kv(tiny, "q_proj", input_ids=ids)[0], dim=-1) - centre_q, dim=-1)
    m_ref = F.normalize(F.normalize(reference_kv(tiny, "k_proj", inputs_embeds=sps), dim=-1) - centre_m, dim=-1)
    assert torch.allclose(q.view(2, 16).double(), q_ref, atol=1e-5)
    assert torch.allclose(m.view(3, 2, 16).double(), m_ref, atol=1e-5)
    # still one unit vector per layer: the cosine of the concatenation is the mean of per-layer cosines
    assert torch.allclose(q.norm(), torch.tensor(2.0**0.5), atol=1e-5)
    assert torch.allclose(builder.memory_key(tiny, sps[0], [1]), m[0], atol=1e-5)
    assert builder.memory_keys(tiny, [], []).shape == (0, 32)
    # and different from the plain kv key (the centre was not zero)
    assert not torch.allclose(q, KVKeyBuilder().query_key(tiny, ids[0]), atol=1e-3)


def test_kv_centered_calibrates_once_per_model_on_the_packaged_questions(
    smol: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elm_memory.data.datasets import load_problems
    from elm_memory.memory.init import question_init

    monkeypatch.setattr(keys_mod, "CENTERING_QUESTIONS", 4)
    monkeypatch.setattr(keys_mod, "_centres", weakref.WeakKeyDictionary())  # these 4-question means stay here
    calls = []
    real = KVCenteredKeyBuilder._calibrate
    monkeypatch.setattr(KVCenteredKeyBuilder, "_calibrate", lambda self, loaded: calls.append(1) or real(self, loaded))
    builder = KVCenteredKeyBuilder()
    centre_q, centre_m = builder.centres(smol)
    assert KVCenteredKeyBuilder().centres(smol)[0] is centre_q and len(calls) == 1  # once per model, any builder
    questions = [p.question for p in load_problems("math500", limit=4, seed=0)]
    plain = KVKeyBuilder()
    tok = smol.tokenizer
    raw_q = torch.stack([plain.query_key(smol, tok(q, add_special_tokens=False)["input_ids"]) for q in questions])
    raw_m = plain.memory_keys(smol, [question_init(smol, q, 20, "question", 0) for q in questions])
    assert torch.allclose(centre_q, raw_q.view(4, 30, 64).mean(0), atol=1e-5)
    assert torch.allclose(centre_m, raw_m.view(4, 30, 64).mean(0), atol=1e-5)
    # centring removes what the calibration questions share: their centred query keys average to ~0 per layer
    centred = torch.stack([builder.query_key(smol, tok(q, add_special_tokens=False)["input_ids"]) for q in questions])
    assert float(centred.view(4, 30, 64).mean(0).norm(dim=-1).max()) < 0.8
    assert float(raw_q.view(4, 30, 64).mean(0).norm(dim=-1).min()) > 0.8
