"""Retriever end to end: the KV index ranking is the paper's mean-of-layer-cosines, namespaces are
hard boundaries, usage is counted, no-consensus and thresholds are honoured."""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elm_memory.config import ELMConfig
from elm_memory.errors import IncompatibleMemoryError
from elm_memory.memory import LatentMemory, TrainingStats
from elm_memory.memory.keys import InputKeyBuilder, KVCenteredKeyBuilder, KVKeyBuilder, SoftPromptMeanKeyBuilder
from elm_memory.models.loading import LoadedModel
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
            for li, layer in enumerate(loaded.model.model.layers):
                y = getattr(layer.self_attn, proj)(layer.input_layernorm(hs[li])).double()
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
        for a, b in zip(got_order, got_order[1:], strict=False):
            assert ref[a] >= ref[b] - 1e-5


def test_input_retrieval_finds_own_question_and_respects_namespaces(smol: LoadedModel, tmp_path: Path) -> None:
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, InputKeyBuilder(), smol)
    mine = [question_memory(smol, q, "mine") for q in QUESTIONS]
    theirs = [question_memory(smol, q, "theirs") for q in QUESTIONS]  # identical keys, other namespace
    retriever.index_memories(mine + theirs)
    for q, m in zip(QUESTIONS, mine, strict=True):
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
    alien = LatentMemory.create(
        torch.randn(20, 64),
        question="x?",
        namespace="default",
        model=type(smol.info)(**{**smol.info.to_dict(), "hidden_size": 64}),
    )
    with pytest.raises(IncompatibleMemoryError):
        retriever.index_memory(alien)


def test_kv_centered_pool_from_config_finds_its_memory(
    smol: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elm_memory.retrieval import keys as keys_mod

    monkeypatch.setattr(keys_mod, "CENTERING_QUESTIONS", 8)  # the calibration's size is not what is tested
    monkeypatch.setattr(keys_mod, "_centres", weakref.WeakKeyDictionary())
    cfg = ELMConfig.load(overrides={"retrieval": {"key": "kv_centered"}, "store": {"path": str(tmp_path / "c")}})
    retriever = Retriever.from_config(cfg, smol)
    assert isinstance(retriever.key_builder, KVCenteredKeyBuilder) and retriever.kind == "kv_centered"
    memories = [question_memory(smol, q) for q in QUESTIONS[:3]]
    for m in memories:
        retriever.index_memory(m)
    assert set(memories[0].keys) == {"kv_centered"} and memories[0].keys["kv_centered"].shape == (30 * 64,)
    assert retriever.store.count("default", kind="kv_centered") == 3
    # each question finds the memory learned from it (SmolLM2, fp32: margins of about 0.2 over the next)
    assert [retriever.retrieve(q, "default")[0].memory.id for q in QUESTIONS[:3]] == [m.id for m in memories]


# ---- gates and the retrieval decision ------------------------------------------------------


def test_weak_majority_gate_skips_weak_memories_and_says_so(smol: LoadedModel, tmp_path: Path) -> None:
    import json

    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, InputKeyBuilder(), smol)
    weak = question_memory(smol, QUESTIONS[0], majority_share=0.25)
    strong = [question_memory(smol, q, majority_share=0.75) for q in QUESTIONS[1:]]
    alone = question_memory(smol, QUESTIONS[0], namespace="alone", majority_share=0.25)
    retriever.index_memories([weak, *strong, alone])

    # off (the default): the weak memory is its own question's top-1
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "default")
    assert hits[0].memory.id == weak.id and d.decision == "used" and d.used
    assert d.candidate_id == weak.id and d.majority_share == pytest.approx(0.25) and d.skipped == 0
    # on: the next memory is used, and the decision says a better one was gated out
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "default", min_majority_share=0.5)
    assert [h.memory.id for h in hits] != [weak.id] and hits[0].memory.id in {m.id for m in strong}
    assert d.decision == "used" and d.candidate_id == hits[0].memory.id
    assert d.similarity == pytest.approx(hits[0].score) and d.majority_share == pytest.approx(0.75)
    assert d.skipped == 1 and d.skipped_by == {"weak_majority": 1}
    # nothing passes: the decision names the gate and the best candidate
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "alone", min_majority_share=0.5)
    assert hits == [] and d.decision == "weak_majority" and d.candidate_id == alone.id
    assert d.similarity == pytest.approx(1.0, abs=1e-5) and d.majority_share == pytest.approx(0.25)
    assert d.threshold == pytest.approx(0.5) and d.skipped == 1
    assert json.loads(json.dumps(d.to_dict())) == {
        "decision": "weak_majority",
        "candidate_id": alone.id,
        "similarity": d.similarity,
        "majority_share": 0.25,
        "threshold": 0.5,
        "skipped": 1,
        "skipped_by": {"weak_majority": 1},
    }
    assert all(r.usage == 0 for r in store.list("alone"))  # a gated memory is not counted as retrieved
    # the retriever's own default (what retrieval.min_majority_share sets) applies to plain retrieve()
    gated = Retriever(store, InputKeyBuilder(), smol, min_majority_share=0.5)
    assert gated.retrieve(QUESTIONS[0], "alone") == []
    assert gated.retrieve(QUESTIONS[0], "alone", min_majority_share=0.0)[0].memory.id == alone.id
    cfg = ELMConfig.load(overrides={"retrieval": {"min_majority_share": 0.5}, "store": {"path": str(tmp_path / "c")}})
    assert Retriever.from_config(cfg, smol).min_majority_share == 0.5
    # a store whose rows lack the share: the blob's stats decide
    real_query = store.query

    def query_without_share(*args, **kwargs):
        hits = real_query(*args, **kwargs)
        return [dataclasses.replace(h, record=dataclasses.replace(h.record, stats={})) for h in hits]

    store.query = query_without_share  # type: ignore[method-assign]
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "alone", min_majority_share=0.5)
    assert hits == [] and d.decision == "weak_majority" and d.majority_share == pytest.approx(0.25)


def test_each_gate_is_named_in_the_decision(smol: LoadedModel, tmp_path: Path) -> None:
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    retriever = Retriever(store, InputKeyBuilder(), smol)
    nc = question_memory(smol, QUESTIONS[0], namespace="nc", no_consensus=True)
    ok = question_memory(smol, QUESTIONS[1], namespace="nc", majority_share=1.0)
    lost = question_memory(smol, QUESTIONS[2], namespace="lost", majority_share=1.0)
    retriever.index_memories([nc, ok, lost])

    hits, d = retriever.retrieve_with_gates("anything at all?", "nobody")
    assert hits == [] and d.to_dict() == {
        "decision": "empty_pool",
        "candidate_id": None,
        "similarity": None,
        "majority_share": None,
        "threshold": None,
        "skipped": 0,
        "skipped_by": {},
    }
    # no consensus: the top candidate is skipped, the next one used
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "nc")
    assert hits[0].memory.id == ok.id and d.decision == "used" and d.skipped_by == {"no_consensus": 1}
    # ... and with a threshold only the no-consensus memory reaches, nothing is used and it is named
    hits, d = retriever.retrieve_with_gates(QUESTIONS[0], "nc", min_similarity=hits[0].score + 1e-3)
    assert hits == [] and d.decision == "no_consensus" and d.candidate_id == nc.id and d.threshold is None
    assert d.skipped_by == {"no_consensus": 1, "below_min_similarity": 1}
    # below min_similarity: the best candidate and the threshold
    [top] = retriever.retrieve(QUESTIONS[1], "nc")
    hits, d = retriever.retrieve_with_gates(QUESTIONS[1], "nc", min_similarity=top.score + 1e-3)
    assert hits == [] and d.decision == "below_min_similarity" and d.candidate_id == ok.id
    assert d.similarity == pytest.approx(top.score) and d.threshold == pytest.approx(top.score + 1e-3)
    assert d.skipped == 1
    # unreadable: a lost blob
    store.blobs.delete(store.record(lost.id).blob)
    hits, d = retriever.retrieve_with_gates(QUESTIONS[2], "lost")
    assert hits == [] and d.decision == "unreadable" and d.candidate_id == lost.id


def test_bad_majority_share_threshold_is_a_config_error(smol: LoadedModel, tmp_path: Path) -> None:
    from elm_memory.errors import ConfigError

    with pytest.raises(ConfigError, match="min_majority_share"):
        ELMConfig.load(overrides={"retrieval": {"min_majority_share": 1.5}})
    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    with pytest.raises(ConfigError, match="min_majority_share"):
        Retriever(store, InputKeyBuilder(), smol, min_majority_share=-0.1)
    with pytest.raises(ConfigError, match="min_majority_share"):
        Retriever(store, InputKeyBuilder(), smol).retrieve(QUESTIONS[0], "default", min_majority_share=2)
