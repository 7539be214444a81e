"""Memory lifecycle (#16): exact utility counters, the min_utility gate, eviction, journalled
deletes that survive a crash, namespace deletion that leaves no trace, TTL expiry."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.memory import LatentMemory, TrainingStats, question_hash
from elm_memory.store.chroma import ChromaMemoryStore
from elm_memory.store.utility import UtilityTable


@pytest.fixture(scope="module")
def info(tiny_loaded):
    """The cpu-tiny model's shapes (SmolLM2-135M): memories and keys of the real size."""
    return tiny_loaded.info


def memory(info, namespace: str = "default", seed: int = 0, question: str | None = None, age_s: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    q = question or f"How much is {seed} plus {seed}?"
    m = LatentMemory.create(
        torch.randn(4, info.hidden_size, generator=g),
        question=q,
        namespace=namespace,
        model=info,
        stats=TrainingStats(steps=1, majority_answer=str(2 * seed), majority_share=1.0),
    )
    m.meta.created_at = time.time() - age_s
    m.meta.question_hash = question_hash(q)
    m.keys = {"input": torch.randn(info.hidden_size, generator=g)}
    return m


def store_at(root: Path, info, **kw) -> ChromaMemoryStore:
    return ChromaMemoryStore(root, model=info, **kw)


def assert_no_row_without_blob(s: ChromaMemoryStore) -> None:
    for r in s.list():
        assert s.blobs.exists(r.blob), f"row {r.id} points at a missing blob"


# ---- counters -----------------------------------------------------------------------------


def test_counters_exact_under_16_threads(tmp_path, info):
    s = store_at(tmp_path / "store", info)
    m = memory(info)
    s.put(m)
    outcomes = ["agree", "won", "lost", "unjudged"]

    def work(t: int) -> None:
        # half the threads share the store's connection, half open their own (as other processes would)
        table = s.utility if t % 2 else UtilityTable(s.root)
        for i in range(50):
            table.record_outcome("default", m.id, outcomes[i % 4], 0.5)
            table.record_usage("default", [m.id])
            if i % 5 == 0:
                table.record_ground_truth("default", m.id, i % 10 == 0)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    u = s.utility_of("default")[m.id]
    assert (u.retrieved, u.agreed, u.won, u.lost) == (800, 208, 208, 192)  # 13/13/12/12 of 50, x16
    assert (u.sim_n, u.sim_sum, u.mean_similarity) == (800, 400.0, 0.5)
    assert u.usage == 800 and s.record(m.id).usage == 800
    assert (u.gold_right, u.gold_wrong) == (80, 80)
    assert u.utility == pytest.approx(416 / 608)


def test_counters_exact_across_processes(tmp_path, info):
    s = store_at(tmp_path / "store", info)
    m = memory(info)
    s.put(m)
    code = (
        "import sys; from elm_memory.store.utility import UtilityTable\n"
        "t = UtilityTable(sys.argv[1])\n"
        "for _ in range(100): t.record_outcome('default', sys.argv[2], 'won', 1.0)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(s.root), m.id]) for _ in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    u = s.utility_of("default")[m.id]
    assert (u.retrieved, u.won) == (400, 400)


# ---- min_utility gate ------------------------------------------------------------------------


def test_min_utility_gate_skips_a_losing_memory(tmp_path, tiny_loaded, info):
    from elm_memory.memory.keys import key_builders
    from elm_memory.retrieval.retriever import Retriever

    s = store_at(tmp_path / "store", info)
    ret = Retriever(s, key_builders.get("input")(), tiny_loaded, min_utility=0.5, min_utility_observations=5)
    q = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    loser = ret.index_memory(memory(info, seed=1, question=q))
    for _ in range(4):
        s.record_outcome("default", loser.id, "lost", 0.9)
    hits, d = ret.retrieve_with_gates(q, "default")
    assert d.decision == "used" and hits[0].memory.id == loser.id  # 4 < 5 observations: still tried
    s.record_outcome("default", loser.id, "lost", 0.9)
    hits, d = ret.retrieve_with_gates(q, "default")
    assert hits == [] and d.decision == "low_utility"
    assert d.candidate_id == loser.id and d.threshold == 0.5 and d.skipped_by == {"low_utility": 1}
    assert set(d.to_dict()) == {
        "decision",
        "candidate_id",
        "similarity",
        "majority_share",
        "threshold",
        "skipped",
        "skipped_by",
    }
    other = ret.index_memory(memory(info, seed=2, question="Ann has 5 pears and eats 2. How many are left?"))
    hits, d = ret.retrieve_with_gates(q, "default")
    assert d.decision == "used" and hits[0].memory.id == other.id and d.skipped_by == {"low_utility": 1}
    for _ in range(6):  # agreements bring it back above the threshold
        s.record_outcome("default", loser.id, "agree", 0.9)
    hits, d = ret.retrieve_with_gates(q, "default")
    assert hits[0].memory.id == loser.id and d.skipped == 0
    off = Retriever(s, key_builders.get("input")(), tiny_loaded)  # default: no gate
    assert off.min_utility is None


# ---- eviction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "victim"), [("lru", 1), ("oldest", 0), ("utility", 2)])
def test_eviction_policies(tmp_path, info, policy, victim):
    s = store_at(tmp_path / "store", info, max_memories=4, eviction=policy)
    ms = [memory(info, "pool", seed=i, age_s=100 - i) for i in range(4)]  # ms[0] oldest
    other = memory(info, "elsewhere", seed=9, age_s=1000)
    s.put_many([*ms, other])
    s.record_usage("input", "pool", [ms[0].id])  # lru: ms[0] just used, ms[1] the least recent
    for _ in range(3):
        s.record_outcome("pool", ms[2].id, "lost", 0.8)  # utility 1/5 after smoothing
        s.record_outcome("pool", ms[0].id, "won", 0.8)
    victim_blob = s.record(ms[victim].id).blob
    new = memory(info, "pool", seed=5)
    s.put(new)
    left = {r.id for r in s.list("pool")}
    assert left == {m.id for m in ms} - {ms[victim].id} | {new.id}
    assert not s.blobs.exists(victim_blob)
    assert ms[victim].id not in s.utility_of("pool")
    assert [r.id for r in s.list("elsewhere")] == [other.id]  # per namespace
    assert len(list(s.blobs)) == 5 and s.check().ok
    # on demand, by another policy: down to 2
    evicted = s.evict("oldest", 2, "pool")
    assert len(evicted) == 2 and s.count("pool") == 2 and s.check().ok


def test_evict_never_takes_what_the_put_wrote(tmp_path, info):
    s = store_at(tmp_path / "store", info, max_memories=2, eviction="oldest")
    old = [memory(info, seed=i, age_s=50) for i in range(2)]
    s.put_many(old)
    batch = [memory(info, seed=10 + i, age_s=500) for i in range(2)]  # older by creation time, yet just written
    s.put_many(batch)
    assert {r.id for r in s.list()} == {m.id for m in batch}


# ---- crash safety -----------------------------------------------------------------------------


def _crash(monkeypatch, obj, method: str) -> None:
    def boom(*a, **k):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(obj, method, boom)


@pytest.mark.parametrize("step", ["before_rows", "before_blob", "before_counters"])
def test_eviction_crash_between_steps_is_repairable(tmp_path, info, monkeypatch, step):
    s = store_at(tmp_path / "store", info)
    ms = [memory(info, seed=i, age_s=10 - i) for i in range(3)]
    s.put_many(ms)
    s.record_outcome("default", ms[0].id, "won", 0.9)
    target = {
        "before_rows": (s, "_delete_rows"),
        "before_blob": (s.blobs, "delete"),
        "before_counters": (s.utility, "forget"),
    }[step]
    _crash(monkeypatch, *target)
    with pytest.raises(RuntimeError, match="simulated crash"):
        s.evict("oldest", 2)
    monkeypatch.undo()
    assert_no_row_without_blob(s)  # at every step: never a row without its blob
    report = s.check()
    assert not report.ok and report.pending_deletes == [f"default/{ms[0].id}"] and report.orphan_rows == []
    assert report.reindexed == []  # a half-deleted memory is not mistaken for a half-written one
    if step == "before_blob":
        assert report.orphan_blobs and s.count() == 2
    res = CliRunner().invoke(memories_app, ["check", "--store", str(s.root), "--repair", "--json"])
    assert res.exit_code == 0, res.output
    assert s.check().ok and {r.id for r in s.list()} == {ms[1].id, ms[2].id}
    assert len(list(s.blobs)) == 2 and ms[0].id not in s.utility_of("default")


def test_reput_after_a_crashed_delete_is_not_deleted_by_the_repair(tmp_path, info, monkeypatch):
    s = store_at(tmp_path / "store", info)
    m = memory(info)
    s.put(m)
    _crash(monkeypatch, s.blobs, "delete")
    with pytest.raises(RuntimeError):
        s.delete(m.id)
    monkeypatch.undo()
    s.put(m)  # e.g. the learner re-learns the question: the interrupted delete is finished first
    assert s.check(repair=True).ok and s.get(m.id).id == m.id


# ---- deletion ---------------------------------------------------------------------------------


def test_delete_namespace_leaves_no_trace(tmp_path, info):
    from elm_memory.graph.services import ELMServices, MemoryCache

    root = tmp_path / "store"
    s = store_at(root, info)
    secret = [memory(info, "secret", seed=i, question=f"zebraquartz private question {i}?") for i in range(4)]
    keep = memory(info, "keep", seed=9)
    s.put_many([*secret, keep])
    s.record_usage("input", "secret", [m.id for m in secret])
    s.record_outcome("secret", secret[0].id, "won", 0.9)
    services = ELMServices(
        config=None, backend=None, prompts=None, retriever=type("R", (), {"store": s})(), memories=MemoryCache()
    )  # type: ignore[arg-type]
    services.memories.put(secret[1])
    assert sorted(s.delete_namespace("secret")) == sorted(m.id for m in secret)
    assert services.memories.get(secret[1].id) is None  # the serving process's cached copy went too
    assert s.compact_index()  # without it, chroma.sqlite3's freed pages keep the question text and ids
    needles = [b"zebraquartz", *(m.id.encode() for m in secret)]
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert not [n for n in needles if n in data], f"{path.relative_to(root)} keeps a deleted memory"
    # and by SQL: no live row of the utility table or Chroma's own tables names them
    db = sqlite3.connect(root / "utility.sqlite3")
    assert db.execute("SELECT count(*) FROM utility WHERE namespace = 'secret'").fetchone() == (0,)
    assert s.namespaces() == ["keep"] and s.check().ok and len(list(s.blobs)) == 1


def test_cli_delete_all_and_check_reports_orphans(tmp_path, info):
    root = tmp_path / "store"
    s = store_at(root, info)
    ms = [memory(info, "gone", seed=i) for i in range(3)]
    s.put_many([*ms, memory(info, "stay", seed=7)])
    run = CliRunner().invoke
    res = run(memories_app, ["delete", "--all", "--store", str(root)])
    assert res.exit_code == 2 and "--namespace" in res.output
    res = run(memories_app, ["delete", "--namespace", "gone", "--all", "--store", str(root), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert sorted(out["deleted"]) == sorted(m.id for m in ms) and out["compacted"] is True
    assert s.count("gone") == 0 and s.count("stay") == 1
    s.utility.record_outcome("gone", ms[0].id, "won", 0.5)  # a late counter for a deleted memory
    res = run(memories_app, ["check", "--store", str(root), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["orphan_utility"] == [f"gone/{ms[0].id}"]
    assert run(memories_app, ["check", "--store", str(root), "--repair"]).exit_code == 0
    assert run(memories_app, ["check", "--store", str(root)]).exit_code == 0


# ---- TTL ----------------------------------------------------------------------------------------


def test_ttl_expired_memories_are_not_retrieved_and_are_removed(tmp_path, info):
    root = tmp_path / "store"
    s = store_at(root, info, ttl_days=1)
    old = memory(info, seed=1, age_s=2 * 86400)
    fresh = memory(info, seed=2)
    unbounded = store_at(root, info)  # no TTL: puts without expiring
    unbounded.put_many([old, fresh])
    hits = s.query("input", old.keys["input"], "default", k=1)  # the old one is the nearest, but expired
    assert [h.record.id for h in hits] == [fresh.id]
    assert [h.record.id for h in unbounded.query("input", old.keys["input"], "default", k=1)] == [old.id]
    run = CliRunner().invoke
    res = run(memories_app, ["evict", "--expired", "--store", str(root), "--json"])
    assert res.exit_code == 2 and "ttl_days" in res.output
    res = run(memories_app, ["evict", "--expired", "--store", str(root), "--set", "store.ttl_days=1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"expired": [old.id], "evicted": []}
    assert [r.id for r in s.list()] == [fresh.id] and s.check().ok
    # opportunistically on put
    unbounded.put(memory(info, seed=3, age_s=3 * 86400))
    s.put(memory(info, seed=4))
    assert s.count() == 2 and s.check().ok


# ---- stats and evict CLI ----------------------------------------------------------------------


def test_cli_stats_and_evict(tmp_path, info):
    root = tmp_path / "store"
    s = store_at(root, info)
    a, b, c = (memory(info, seed=i, age_s=10 - i) for i in range(3))
    s.put_many([a, b, c])
    for outcome in ("won", "won", "lost", "agree"):
        s.record_outcome("default", a.id, outcome, 0.75)
    for outcome in ("lost", "lost", "won"):
        s.record_outcome("default", b.id, outcome, 0.25)
    run = CliRunner().invoke
    res = run(memories_app, ["stats", "--store", str(root), "--sort", "lost", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["id"] for r in rows] == [b.id, a.id, c.id]
    assert (rows[1]["won"], rows[1]["agreed"], rows[1]["lost"], rows[1]["retrieved"]) == (2, 1, 1, 4)
    assert rows[1]["utility"] == 0.75 and rows[1]["mean_similarity"] == 0.75 and rows[2]["utility"] is None
    res = run(memories_app, ["stats", "--store", str(root), "--sort", "utility"])
    assert res.exit_code == 0 and res.stdout.splitlines()[1].startswith(f"{a.id[:12]}  ")  # a short id
    assert run(memories_app, ["stats", "--store", str(root), "--sort", "bogus"]).exit_code == 2
    assert run(memories_app, ["evict", "--store", str(root)]).exit_code == 2  # no --keep, no max_memories
    res = run(memories_app, ["evict", "--store", str(root), "--policy", "utility", "--keep", "2", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["evicted"] == [b.id]
    res = run(memories_app, ["evict", "--store", str(root), "--policy", "nope", "--keep", "1"])
    assert res.exit_code == 2 and "eviction policy" in res.output


# ---- the answer path records outcomes -------------------------------------------------------------


@pytest.mark.model
def test_graph_records_outcomes_and_never_fails_on_them(tmp_path, tiny_loaded, tiny_backend, monkeypatch):
    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM

    class Fixed:
        name = "fixed"

        def __init__(self, scores):
            self.scores = scores

        def score(self, question, responses):
            return list(self.scores)

    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "model": {"dtype": "float32"},
            "store": {"path": str(tmp_path / "store")},
            "training": {"steps": 0},
            "retrieval": {"skip_no_consensus": False},
            "generation": {"max_new_tokens": 16},
        },
    )
    elm = ELM(cfg, loaded=tiny_loaded, backend=tiny_backend)
    try:
        q1 = "Tom has 3 apples and buys 4 more. How many apples does he have?"
        q2 = "Tom has 3 pears and buys 4 more. How many pears does he have?"
        elm.answer(q1)
        store = elm.retriever.store
        for scores, expected in (([0.1, 0.9], "won"), ([0.9, 0.1], "lost")):
            elm._services, elm._verifier = None, Fixed(scores)
            r = elm.answer(q2, learn=False)
            assert r.route == "verifier" and r.memory_id is not None
            u = store.utility_of("default")[r.memory_id]
            assert getattr(u, expected) == 1 and u.sim_n == u.retrieved
        assert (u.retrieved, u.won, u.lost, u.agreed) == (2, 1, 1, 0)
        assert u.mean_similarity == pytest.approx(r.similarity)
        monkeypatch.setattr(store, "record_outcome", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk full")))
        r = elm.answer(q2, learn=False)
        assert r.answer == r.candidates[0]["answer"] and any("could not record the outcome" in w for w in r.warnings)
    finally:
        elm.close()
