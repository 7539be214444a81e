"""Retriever end to end: the KV index ranking is the paper's mean-of-layer-cosines, namespaces are
hard boundaries, usage is counted, no-consensus and thresholds are honoured."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elm_memory.config import ELMConfig
from elm_memory.errors import IncompatibleMemoryError
from elm_memory.memory import LatentMemory, TrainingStats
from elm_memory.models.loading import LoadedModel
from elm_memory.retrieval.keys import InputKeyBuilder, KVKeyBuilder, SoftPromptMeanKeyBuilder
from elm_memory.retrieval.retriever import Hit, Retriever, tokenize_question
from elm_memory.store.chroma import ChromaMemoryStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = [
    "Janet's ducks lay 16 eggs per day. She eats three and sells the rest at $2 each. How much does she make?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
    "Convert the point (0,3) in rectangular coordinates to polar coordinates.",
    "What is the smallest positive integer n such that 17n is congruent to 1234 modulo 7?",
    "If f(x) = 3x + 2, what is f(f(1))?",
    "How many vertical asymptotes does the graph of y = 2/(x^2 + x - 6) have?",
    "Tom has twice as many marbles as Sara. Together they have 36. How many does Tom have?",
    "Find the sum of all integer solutions of x^2 - 5x + 4 = 0.",
]


@pytest.fixture(scope="module")
def smol(tiny_loaded):
    """The session's SmolLM2-135M (conftest), run on one thread: 2 threads on a busy 2-core box
    were measured 8x slower than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_loaded
    finally:
        torch.set_num_threads(threads)


def question_memory(loaded: LoadedModel, question: str, namespace: str = "default", **stats) -> LatentMemory:
    """A memory as training would start it: the question's embeddings tiled to k=20, plus a nudge."""
    ids = torch.tensor(tokenize_question(loaded.tokenizer, question))
    emb = loaded.model.get_input_embeddings().weight.detach()
    sp = emb[ids.repeat(20 // len(ids) + 1)[:20]] + 0.01 * torch.randn(20, loaded.info.hidden_size)
    stats_ = TrainingStats(**stats)
    return LatentMemory.create(sp, question=question, namespace=namespace, model=loaded.info, stats=stats_)


def reference_mean_layer_cos(loaded: LoadedModel, question: str, soft_prompts: torch.Tensor) -> torch.Tensor:
    """Paper KV score computed from output_hidden_states (no hooks, no concatenation trick)."""
    info = loaded.info
    ids = torch.tensor([tokenize_question(loaded.tokenizer, question)])

    def pooled(proj: str, n_heads: int, **inputs) -> torch.Tensor:
        with torch.no_grad():
            hs = loaded.model(**inputs, output_hidden_states=True, use_cache=False).hidden_states
            out = []
            for l, layer in enumerate(loaded.model.model.layers):
                y = getattr(layer.self_attn, proj)(layer.input_layernorm(hs[l])).double()
                out.append(y.view(y.shape[0], y.shape[1], n_heads, info.head_dim).mean(dim=(1, 2)))
        return torch.stack(out, dim=1)  # (b, L, hd)

    q = pooled("q_proj", info.num_attention_heads, input_ids=ids)  # (1, L, hd)
    k = pooled("k_proj", info.num_key_value_heads, inputs_embeds=soft_prompts)  # (N, L, hd)
    return F.cosine_similarity(q, k, dim=-1).mean(dim=-1)


def test_kv_index_ranking_equals_brute_force_mean_of_layer_cosines(smol: LoadedModel, tmp_path: Path) -> None:
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, KVKeyBuilder(), smol, record_usage=False)
    torch.manual_seed(0)
    mems = [question_memory(smol, q) for q in QUESTIONS]
    # more memories than questions: random soft prompts at the embedding scale
    scale = smol.model.get_input_embeddings().weight.std().item()
    for i in range(10):
        sp = torch.randn(20, smol.info.hidden_size) * scale
        mems.append(LatentMemory.create(sp, question=f"random {i}", namespace="default", model=smol.info))
    retriever.index_memories(mems)
    sps = torch.stack([m.soft_prompt for m in mems])
    for question in (QUESTIONS[0], QUESTIONS[5], "What is 12 times 13?"):
        ref = reference_mean_layer_cos(smol, question, sps)
        hits = retriever.retrieve(question, "default", k=len(mems), skip_no_consensus=False)
        order = torch.argsort(ref, descending=True)
        got_scores = torch.tensor([h.score for h in hits], dtype=torch.float64)
        assert torch.allclose(got_scores, ref[order], atol=1e-5), question
        # same ranking wherever the brute-force scores are not tied within float32 noise
        by_id = {m.id: i for i, m in enumerate(mems)}
        got_order = [by_id[h.memory.id] for h in hits]
        for a, b in zip(got_order, got_order[1:]):
            assert ref[a] >= ref[b] - 1e-5


def test_input_retrieval_finds_own_question_and_respects_namespaces(smol: LoadedModel, tmp_path: Path) -> None:
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, InputKeyBuilder(), smol)
    mine = [question_memory(smol, q, "mine") for q in QUESTIONS]
    theirs = [question_memory(smol, q, "theirs") for q in QUESTIONS]  # identical keys, other namespace
    retriever.index_memories(mine + theirs)
    for q, m in zip(QUESTIONS, mine):
        [hit] = retriever.retrieve(q, "mine")
        assert isinstance(hit, Hit) and hit.memory.id == m.id and hit.score == pytest.approx(1.0, abs=1e-5)
        assert hit.memory.meta.namespace == "mine"
    everything = retriever.retrieve(QUESTIONS[0], "mine", k=100)
    assert {h.memory.id for h in everything} == {m.id for m in mine}
    assert retriever.retrieve(QUESTIONS[0], "nobody", k=5) == []
    usage = {r.id: r.usage for r in store.list("mine")}
    assert usage[mine[0].id] == 2 and usage[mine[1].id] == 2  # own-question hit + the k=100 sweep
    assert all(r.usage == 0 for r in store.list("theirs"))


def test_soft_prompt_mean_key_skips_no_consensus_and_applies_threshold(
    smol: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, SoftPromptMeanKeyBuilder(), smol)
    bad = question_memory(smol, QUESTIONS[0], no_consensus=True)
    good = [question_memory(smol, q) for q in QUESTIONS[1:]]
    retriever.index_memories([bad, *good])
    assert retriever.retrieve(QUESTIONS[0], "default", skip_no_consensus=False)[0].memory.id == bad.id
    hits = retriever.retrieve(QUESTIONS[0], "default", k=3)
    assert len(hits) == 3 and bad.id not in {h.memory.id for h in hits}
    assert hits[0].score >= hits[1].score >= hits[2].score
    assert retriever.retrieve(QUESTIONS[0], "default", min_similarity=hits[0].score + 1e-3) == []
    only_best = retriever.retrieve(QUESTIONS[0], "default", k=5, min_similarity=hits[1].score + 1e-6)
    assert [h.memory.id for h in only_best] == [hits[0].memory.id]
    # a lost blob is skipped with a warning, the next memory is returned
    store.blobs.delete(store.list()[[r.id for r in store.list()].index(hits[0].memory.id)].blob)
    with caplog.at_level(logging.WARNING):
        [h] = retriever.retrieve(QUESTIONS[0], "default")
    assert h.memory.id == hits[1].memory.id and "skipping memory" in caplog.text


def test_from_config_and_incompatible_memory(smol: LoadedModel, tmp_path: Path) -> None:
    cfg = ELMConfig.load(overrides={"retrieval": {"key": "kv"}, "store": {"path": str(tmp_path / "cfg-store")}})
    retriever = Retriever.from_config(cfg, smol)
    assert isinstance(retriever.key_builder, KVKeyBuilder) and isinstance(retriever.store, ChromaMemoryStore)
    m = question_memory(smol, QUESTIONS[2])
    retriever.index_memory(m)
    assert m.keys["kv"].shape == (30 * 64,)
    assert retriever.retrieve(QUESTIONS[2], "default")[0].memory.id == m.id
    alien = LatentMemory.create(torch.randn(20, 64), question="x?", namespace="default",
                                model=type(smol.info)(**{**smol.info.to_dict(), "hidden_size": 64}))  # fmt: skip
    with pytest.raises(IncompatibleMemoryError):
        retriever.index_memory(alien)
