"""Merging near-duplicate memories (#16 item 4): clusters, the average and train strategies, provenance,
summed counters, the CLI, a kill -9 at every step of a merge, and answers that never fail while a pool
is evicted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _fakes import fake_memory, fake_model_info
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.errors import MemoryFormatError
from elm_memory.memory import LatentMemory, MemoryMeta
from elm_memory.store.chroma import ChromaMemoryStore
from elm_memory.store.merge import (
    cluster_keys,
    combine_keys,
    find_clusters,
    merge_namespace,
)

HIDDEN = 8


def near(base: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    """``base`` plus a small random nudge (cosine with ``base`` close to 1 for small ``eps``)."""
    g = torch.Generator().manual_seed(seed)
    return base + eps * torch.randn(base.shape, generator=g)


def pool(info, namespace: str = "pool", *, base_seed: int = 0, n_near: int = 3, n_far: int = 2):
    """``n_near`` memories whose keys are near-copies of one direction, and ``n_far`` unrelated ones."""
    base = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1000 + base_seed))
    out = []
    for i in range(n_near):
        m = fake_memory(info, namespace, base_seed * 100 + i, keys={"input": near(base, 0.01, i)})
        m.meta.created_at = 1_000_000.0 + i
        out.append(m)
    for i in range(n_far):
        out.append(fake_memory(info, namespace, base_seed * 100 + 50 + i))
    return out


# ---- clusters ---------------------------------------------------------------------------------


def test_clusters_are_complete_link_and_honour_the_threshold():
    e = np.eye(4, dtype=np.float32)
    a = e[0]
    b = np.cos(0.2) * e[0] + np.sin(0.2) * e[1]  # cos(a, b) = 0.980
    c = np.cos(0.4) * e[0] + np.sin(0.4) * e[1]  # cos(b, c) = 0.980, cos(a, c) = 0.921: a chain
    d = e[2]
    dup = 2.0 * e[2] + 0.01 * e[3]  # a copy of d at another scale: cosine ignores the norm
    m = np.stack([a, b, c, d, dup])
    assert cluster_keys(m, 0.97) == [
        ([0, 1], pytest.approx(float(np.cos(0.2)), abs=1e-6)),
        ([3, 4], pytest.approx(1.0, abs=1e-4)),
    ]
    assert [ids for ids, _ in cluster_keys(m, 0.9)] == [[0, 1, 2], [3, 4]]  # every pair above 0.9
    assert [ids for ids, _ in cluster_keys(m, 0.99)] == [[3, 4]]
    assert cluster_keys(np.zeros((0, 4), np.float32), 0.9) == []
    with pytest.raises(Exception, match="threshold"):
        cluster_keys(m, 1.5)


def test_find_clusters_never_across_namespaces_or_models(tmp_path):
    one, other = fake_model_info(HIDDEN), fake_model_info(HIDDEN, fingerprint="fedcba9876543210", name="other")
    s = ChromaMemoryStore(tmp_path / "store")  # unbound: sees every model's memories
    same_key = torch.ones(HIDDEN)
    memories = [
        fake_memory(one, "a", 1, keys={"input": same_key}),
        fake_memory(one, "a", 2, keys={"input": same_key * 3}),
        fake_memory(one, "b", 3, keys={"input": same_key}),  # same key, other namespace
        fake_memory(other, "a", 4, keys={"input": same_key}),  # same key, other model
        fake_memory(other, "a", 5, keys={"input": -same_key}),
    ]
    s.put_many(memories)
    clusters = find_clusters(s, kind="input", threshold=0.99)
    assert len(clusters) == 1
    c = clusters[0]
    assert (c.namespace, c.fingerprint, c.kind) == ("a", one.fingerprint, "input")
    assert set(c.ids) == {memories[0].id, memories[1].id}
    assert find_clusters(s, namespace="b", threshold=0.5) == []
    assert find_clusters(s, kind="kv", threshold=0.5) == []  # no such collection


# ---- the average strategy -----------------------------------------------------------------------


def test_average_merge_result_provenance_and_counters(tmp_path):
    info = fake_model_info(HIDDEN)
    s = ChromaMemoryStore(tmp_path / "store")
    ms = pool(info)
    s.put_many(ms)
    near_ids = [m.id for m in ms[:3]]
    s.record_outcome("pool", ms[0].id, "won", 0.9)
    s.record_outcome("pool", ms[1].id, "lost", 0.5)
    s.record_outcome("pool", ms[1].id, "agree", 0.7)
    s.record_ground_truth("pool", ms[2].id, True)
    s.record_usage("input", "pool", [ms[2].id])
    [outcome] = merge_namespace(s, namespace="pool", threshold=0.99)
    assert set(outcome.deleted) == set(near_ids) and set(outcome.cluster.ids) == set(near_ids)
    merged = s.get(outcome.merged_id, "pool")
    expected = torch.stack([m.soft_prompt for m in ms[:3]]).mean(dim=0)
    torch.testing.assert_close(merged.soft_prompt, expected)
    torch.testing.assert_close(merged.keys["input"], torch.stack([m.keys["input"] for m in ms[:3]]).mean(dim=0))
    meta = merged.meta
    assert meta.merged_from == near_ids and meta.merge_strategy == "average"  # oldest first
    assert meta.question == ms[0].meta.question and meta.created_at == ms[2].meta.created_at
    assert meta.config["merge"]["strategy"] == "average" and meta.stats.engine == "merge"
    assert meta.stats.majority_answer == "42" and meta.stats.majority_share == pytest.approx(0.5)
    # the saved file carries the provenance and loads back
    path = merged.save(tmp_path / "merged.safetensors")
    assert LatentMemory.load(path).meta.merged_from == near_ids
    # members gone (rows, blobs, counters); the merged memory holds their summed counters
    assert {r.id for r in s.list("pool")} == {merged.id, ms[3].id, ms[4].id}
    assert len(list(s.blobs)) == 3 and s.check().ok
    u = s.utility_of("pool")
    assert set(u) == {merged.id}
    m_u = u[merged.id]
    assert (m_u.retrieved, m_u.won, m_u.lost, m_u.agreed, m_u.usage, m_u.gold_right) == (3, 1, 1, 1, 1, 1)
    assert m_u.sim_sum == pytest.approx(2.1)
    # merging again finds nothing near enough
    assert merge_namespace(s, namespace="pool", threshold=0.99) == []


def test_merge_threshold_policy_merges_a_landing_near_duplicate(tmp_path):
    from elm_memory.config import StoreConfig

    info = fake_model_info(HIDDEN)
    cfg = StoreConfig(path=str(tmp_path / "store"), merge_threshold=0.99)
    s = ChromaMemoryStore.from_config(cfg)
    assert s.merge_threshold == 0.99 and ChromaMemoryStore(tmp_path / "off").merge_threshold is None
    near_ones, far = pool(info, n_near=3, n_far=1)[:3], pool(info, n_far=1)[3]
    s.put(far)
    s.put(near_ones[0])
    assert s.count() == 2  # nothing near yet
    s.put(near_ones[1])  # lands next to near_ones[0]: both become one
    [merged] = [r for r in s.list("pool") if r.id != far.id]
    assert s.get(merged.id).meta.merged_from == [near_ones[0].id, near_ones[1].id]
    s.put(near_ones[2])  # lands next to the merged memory: merged again, provenance of the merge before it
    [again] = [r for r in s.list("pool") if r.id != far.id]
    assert s.get(again.id).meta.merged_from == [merged.id, near_ones[2].id]
    assert s.count() == 2 and len(list(s.blobs)) == 2 and s.check().ok
    with pytest.raises(Exception, match="merge_threshold"):
        ChromaMemoryStore(tmp_path / "bad", merge_threshold=1.5)


def test_memory_files_without_provenance_still_load_and_bad_provenance_is_refused():
    info = fake_model_info(HIDDEN)
    m = fake_memory(info)
    assert "merged_from" not in json.loads(m.meta.to_json())  # unmerged files are what older versions wrote
    assert LatentMemory.from_bytes(m.to_bytes()).meta.merged_from == []
    raw = json.loads(m.meta.to_json())
    bad = [
        {"merged_from": ["not-hex!"], "merge_strategy": "average"},
        {"merged_from": "abcdef01", "merge_strategy": "average"},
        {"merged_from": [m.id], "merge_strategy": "average"},  # itself
        {"merged_from": ["abcdef01", "abcdef01"], "merge_strategy": "average"},
        {"merged_from": ["abcdef01"]},  # no strategy
        {"merged_from": [], "merge_strategy": "average"},
        {"merged_from": ["abcdef01"], "merge_strategy": "x" * 100},
    ]
    for extra in bad:
        with pytest.raises(MemoryFormatError):
            MemoryMeta.from_json(json.dumps({**raw, **extra}))
    ok = MemoryMeta.from_json(json.dumps({**raw, "merged_from": ["abcdef01"], "merge_strategy": "train"}))
    assert ok.merged_from == ["abcdef01"]


@pytest.mark.parametrize("kind", ["kv", "kv_centered"])
def test_kv_keys_are_renormalised_per_layer(kind):
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.functional.normalize(torch.randn(3, 4, generator=g), dim=-1).reshape(-1) for _ in range(2)]
    merged = combine_keys(kind, layers)
    assert merged.view(3, 4).norm(dim=-1).tolist() == pytest.approx([1.0, 1.0, 1.0])
    torch.testing.assert_close(combine_keys("input", layers), (layers[0] + layers[1]) / 2)


def test_cli_merge_dry_run_then_merge(tmp_path):
    info = fake_model_info(HIDDEN)
    root = tmp_path / "store"
    s = ChromaMemoryStore(root)
    ms = pool(info, n_near=2, n_far=1)
    s.put_many(ms)
    run = CliRunner().invoke
    res = run(memories_app, ["merge", "--store", str(root), "--threshold", "0.99", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["dry_run"] and [c["ids"] for c in out["clusters"]] == [[ms[0].id, ms[1].id]]
    assert out["clusters"][0]["merged_id"] is None and s.count() == 3
    res = run(memories_app, ["merge", "--store", str(root), "--threshold", "0.99", "--namespace", "pool"])
    assert res.exit_code == 0, res.output
    assert f"  {ms[0].id[:12]}  question" in res.stdout and ms[0].id not in res.stdout  # short ids in tables
    assert "->" in res.stdout and "merged 2 memories into 1" in res.output
    assert s.count() == 2 and s.check().ok
    assert run(memories_app, ["merge", "--store", str(root), "--strategy", "nope"]).exit_code == 2
    assert run(memories_app, ["merge", "--store", str(root), "--threshold", "2"]).exit_code == 2


# ---- kill -9 at every step of a merge ----------------------------------------------------------------

_CHILD = """
import sys
from elm_memory.store.chroma import ChromaMemoryStore
from elm_memory.store.merge import merge_namespace
merge_namespace(ChromaMemoryStore(sys.argv[1]), namespace="pool", threshold=0.99)
"""


def _run_child(root: Path, env_extra: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("ELM_FAULT", "ELM_FAULT_TRACE")} | env_extra
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _merge_template(tmp_path: Path) -> tuple[Path, list[LatentMemory]]:
    """A pool of three near-duplicates (with counters) and one other memory, written once and copied per run."""
    info = fake_model_info(HIDDEN)
    template = tmp_path / "template"
    s = ChromaMemoryStore(template)
    ms = pool(info, n_near=3, n_far=1)
    s.put_many(ms)
    for m, outcome in zip(ms[:3], ("won", "lost", "agree"), strict=True):
        s.record_outcome("pool", m.id, outcome, 0.5)
    s.utility.checkpoint()
    return template, ms


def _calibrate(tmp_path: Path, template: Path) -> list[str]:
    """Every fault point (elm_memory/faults.py) one merge passes, in order, as ``NAME@N:kill`` plans."""
    trace = tmp_path / "trace.txt"
    shutil.copytree(template, tmp_path / "calib")
    proc = _run_child(tmp_path / "calib", {"ELM_FAULT_TRACE": str(trace)})
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    seen: dict[str, int] = {}
    plans = []
    for name in trace.read_text().split():
        seen[name] = seen.get(name, 0) + 1
        plans.append(f"{name}@{seen[name]}:kill")
    return plans


def _kill_and_check(tmp_path: Path, template: Path, ms: list[LatentMemory], plans: list[str]) -> dict[str, int]:
    """One child per plan, two at a time, each killing itself with SIGKILL there; then per pool: no row
    without its blob, ``check`` clean or made clean by ``check --repair``, and either the members
    (untouched) or the merged memory (members gone, their counters summed once), never both."""
    members = {m.id for m in ms[:3]}
    roots = {plan: tmp_path / f"kill{i}" for i, plan in enumerate(plans)}
    for root in roots.values():
        shutil.copytree(template, root)
    pending = list(plans)
    while pending:
        batch, pending = pending[:2], pending[2:]
        procs = [(plan, _run_child(roots[plan], {"ELM_FAULT": plan})) for plan in batch]
        for plan, p in procs:
            assert p.wait(timeout=120) == -signal.SIGKILL, f"{plan}: {p.stderr.read() if p.stderr else ''}"
    outcomes = {"members": 0, "merged": 0, "interrupted_merges": 0}
    for plan, root in roots.items():
        s = ChromaMemoryStore(root)
        for r in s.list():
            assert s.blobs.exists(r.blob), f"{plan}: row {r.id} has no blob"
        report = s.check(temp_grace_seconds=0)
        outcomes["interrupted_merges"] += bool(report.interrupted_merges)
        if not report.ok:
            fixed = s.check(repair=True, temp_grace_seconds=0)
            assert not fixed.errors, f"{plan}: {fixed.errors}"
        assert s.check().ok, f"{plan}: {s.check().to_dict()}"
        ids = {r.id for r in s.list("pool")}
        merged = [r for r in s.list("pool") if r.id not in members and r.id != ms[3].id]
        assert ms[3].id in ids
        if merged:
            assert not ids & members, f"{plan}: merged memory and members both present"
            [m] = merged
            u = s.utility_of("pool")[m.id]
            assert (u.won, u.lost, u.agreed, u.retrieved) == (1, 1, 1, 3), plan
            outcomes["merged"] += 1
        else:
            assert ids == members | {ms[3].id}, plan
            assert sum(u.retrieved for u in s.utility_of("pool").values()) == 3, plan
            outcomes["members"] += 1
        assert len(list(s.blobs)) == len(ids), f"{plan}: a blob counted twice or missing"
    return outcomes


def test_merge_killed_at_its_own_steps_leaves_a_repairable_pool(tmp_path):
    """The default run: kill -9 in the merged memory's blob write, after it is written, after the counters
    moved, and in the members' delete (the full sweep is the slow test below)."""
    template, ms = _merge_template(tmp_path)
    plans = ["blob.fsynced@1:kill", "merge.written@1:kill", "merge.absorbed@1:kill", "blob.delete@2:kill"]
    outcomes = _kill_and_check(tmp_path, template, ms, plans)
    # merge.written: an interrupted merge; merge.absorbed, blob.delete: journalled deletes to finish
    assert outcomes == {"members": 1, "merged": 3, "interrupted_merges": 1}


@pytest.mark.slow
def test_merge_killed_at_every_step_leaves_a_repairable_pool(tmp_path):
    template, ms = _merge_template(tmp_path)
    plans = _calibrate(tmp_path, template)
    assert {"merge.written@1:kill", "merge.absorbed@1:kill", "index.delete@1:kill", "blob.delete@3:kill"} <= set(plans)
    outcomes = _kill_and_check(tmp_path, template, ms, plans)
    assert outcomes["members"] and outcomes["merged"] and outcomes["interrupted_merges"], outcomes
    print(f"merge kill points: {len(plans)} {outcomes}")


# ---- answers during eviction ----------------------------------------------------------------------


class _FixedKey:
    """A key builder that returns a fixed query vector: retrieval without a model."""

    kind = "input"

    def __init__(self, vectors):
        self.vectors = vectors
        self.i = 0

    def dim(self, info):
        return HIDDEN

    def query_key(self, loaded, question_ids):
        self.i += 1
        return self.vectors[self.i % len(self.vectors)]


def test_retrievals_never_fail_during_eviction_and_merge(tmp_path):
    from elm_memory.retrieval.retriever import Retriever

    info = fake_model_info(HIDDEN)
    s = ChromaMemoryStore(tmp_path / "store", model=info)
    ms = [fake_memory(info, "pool", i) for i in range(120)]
    for i, m in enumerate(ms):
        m.meta.created_at = 1_000_000.0 + i
    s.put_many(ms)
    errors: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    def answer(seed: int) -> None:
        ret = Retriever(s, _FixedKey([m.keys["input"] for m in ms[seed::4]]), loaded=None)  # type: ignore[arg-type]
        while not stop.is_set():
            try:
                hits = ret.retrieve([1, 2, 3], "pool", k=1, skip_no_consensus=False)
                assert all(isinstance(h.memory, LatentMemory) for h in hits)
                answered[0] += 1
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    threads = [threading.Thread(target=answer, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    try:
        assert merge_namespace(s, namespace="pool", threshold=0.8)  # random 8-d keys: some pairs are this close
        for keep in (90, 60, 30, 10, 1):
            s.evict("lru", keep, "pool")
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[:3]
    assert answered[0] > 0 and s.count("pool") == 1
    s.check(repair=True)  # usage counted for a memory as it was evicted is an orphan counter
    assert s.check().ok


def test_rebuild_index_after_eviction_keeps_the_live_rows(tmp_path):
    info = fake_model_info(HIDDEN)
    root = tmp_path / "store"
    s = ChromaMemoryStore(root, model=info)
    ms = [fake_memory(info, "pool", i) for i in range(40)]
    for i, m in enumerate(ms):
        m.meta.created_at = 1_000_000.0 + i
    s.put_many([*ms, fake_memory(info, "other", 99)])
    s.evict("oldest", 5, "pool")
    res = CliRunner().invoke(memories_app, ["compact", "--store", str(root), "--namespace", "pool", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"rows": 5, "compacted": True}
    s = ChromaMemoryStore(root, model=info)
    assert [r.id for r in s.list("pool")] == [m.id for m in ms[-5:]] and s.count("other") == 1
    for m in ms[-5:]:
        assert s.query("input", m.keys["input"], "pool", k=1)[0].record.id == m.id
    assert s.check().ok


# ---- the train strategy on a real small pool (cpu-tiny) -------------------------------------------------


@pytest.mark.model
def test_train_merge_on_cpu_tiny(tmp_path, smol, tiny_backend):
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig
    from elm_memory.memory.keys import key_builders
    from elm_memory.retrieval.retriever import Retriever
    from elm_memory.training.learn import learn_memories
    from elm_memory.training.merging import initial_prompt, train_merged

    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={"model": {"dtype": "float32"}, "memory": {"num_tokens": 4}, "training": {"steps": 1}},
    )
    prompts = PromptBuilder(tiny_backend.tokenizer, cfg.prompt, max_context=tiny_backend.info.max_context)
    questions = ["What is 12 plus 30?", "What is 12 plus 31?", "Name a colour of the sky at noon."]
    learned = learn_memories(questions, config=cfg, loaded=smol, backend=tiny_backend, prompts=prompts, progress=False)
    s = ChromaMemoryStore(tmp_path / "store", model=smol.info)
    ret = Retriever(s, key_builders.get("input")(), smol)
    ret.index_memories(learned)
    clusters = find_clusters(s, namespace="default", threshold=0.9)
    assert [set(c.ids) for c in clusters] == [{learned[0].id, learned[1].id}]
    # the rebuilt initial prompt is the one training started from (question embeddings, tiled)
    ids = smol.tokenizer(questions[0], add_special_tokens=False)["input_ids"]
    emb = smol.model.get_input_embeddings().weight
    torch.testing.assert_close(initial_prompt(learned[0], smol, cfg)[0], emb[ids[0]].detach().float())

    def build(members):
        return train_merged(members, config=cfg, loaded=smol, backend=tiny_backend, prompts=prompts, steps=1)

    from elm_memory.store.merge import merge_clusters

    [outcome] = merge_clusters(s, clusters, build)
    merged = s.get(outcome.merged_id, "default")
    assert merged.meta.merge_strategy == "train" and merged.meta.merged_from == [learned[0].id, learned[1].id]
    assert merged.meta.stats.steps == 1 and merged.meta.config["merge"]["steps"] == 1
    assert merged.soft_prompt.shape == (4, smol.info.hidden_size) and torch.isfinite(merged.soft_prompt).all()
    assert s.count() == 2 and s.check().ok
    hits = ret.retrieve(questions[1], "default", skip_no_consensus=False)
    assert hits and hits[0].memory.id == merged.id
    # training starts from the mean of the members' initial prompts; SmolLM2 never writes \\boxed{}, so its
    # rewards are uniform and the step skips its backward: the merged prompt is exactly that mean
    init = torch.stack([initial_prompt(m, smol, cfg) for m in learned[:2]]).mean(dim=0)
    if all(merged.meta.stats.skipped_backward):
        torch.testing.assert_close(merged.soft_prompt, init)
    else:
        assert not torch.allclose(merged.soft_prompt, init)
