"""Memory store: blobs, Chroma rows, namespaces, refusal, crash safety, the CLI, and a real Chroma server."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from _fakes import fake_memory, fake_model_info
from _servers import chroma_server as real_chroma_server
from _servers import free_port
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.errors import AmbiguousMemoryIdError, IncompatibleMemoryError, MemoryFormatError, StoreError
from elm_memory.memory import LatentMemory
from elm_memory.models.loading import ModelInfo
from elm_memory.store.base import MemoryNotFoundError, MemoryStore, match_prefixes
from elm_memory.store.blobs import BlobStore, MissingBlobError
from elm_memory.store.chroma import ChromaMemoryStore, collection_name

HIDDEN = 8


@pytest.fixture
def info() -> ModelInfo:
    return fake_model_info()


@pytest.fixture
def store(tmp_path: Path, info: ModelInfo) -> ChromaMemoryStore:
    return ChromaMemoryStore(tmp_path / "store", model=info)


# ---- blobs ----------------------------------------------------------------------------


def test_blob_roundtrip_sharded_and_verified(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b"hello")
    assert blobs.path(sha) == tmp_path / sha[:2] / sha[2:4] / f"{sha}.safetensors"
    assert blobs.get(sha) == b"hello" and list(blobs) == [sha]
    assert blobs.put(b"hello") == sha  # idempotent
    blobs.path(sha).write_bytes(b"hellO")
    with pytest.raises(MemoryFormatError, match="corrupt"):
        blobs.get(sha)
    assert blobs.delete(sha) and not blobs.delete(sha)
    with pytest.raises(MissingBlobError):
        blobs.get(sha)
    with pytest.raises(StoreError, match="invalid blob name"):
        blobs.path("../../etc/passwd")


def test_interrupted_blob_write_leaves_no_partial_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = BlobStore(tmp_path)

    def half_then_crash(fh, data: bytes) -> None:
        fh.write(data[: len(data) // 2])
        raise KeyboardInterrupt  # not even an Exception: cleanup must still run

    monkeypatch.setattr(BlobStore, "_write", staticmethod(half_then_crash))
    with pytest.raises(KeyboardInterrupt):
        blobs.put(b"x" * 1000)
    assert list(blobs) == [] and blobs.temp_files() == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# ---- store basics -----------------------------------------------------------------------


def test_store_satisfies_protocol(store: ChromaMemoryStore) -> None:
    assert isinstance(store, MemoryStore)


def test_roundtrip_is_bit_identical_and_persistent(tmp_path: Path, store: ChromaMemoryStore, info: ModelInfo) -> None:
    m = fake_memory(info, keys={"input": torch.randn(HIDDEN), "kv": torch.randn(8)})
    m.soft_prompt[0, 0] = 1e-38  # a denormal-adjacent value survives too
    sha = store.put(m)
    reopened = ChromaMemoryStore(tmp_path / "store", model=info)
    got = reopened.get(m.id)
    assert got.soft_prompt.numpy().tobytes() == m.soft_prompt.numpy().tobytes()
    assert got.meta == m.meta and set(got.keys) == {"input", "kv"}
    assert all(torch.equal(got.keys[k], m.keys[k]) for k in m.keys)
    assert store.blobs.exists(sha)
    [rec] = reopened.list()
    assert rec.kinds == ("input", "kv") and rec.blob == sha and rec.question == "question 0?"
    assert rec.stats["train_steps"] == 3 and rec.stats["majority_answer"] == "42"
    assert reopened.count() == 1 and reopened.count(kind="kv") == 1 and reopened.namespaces() == ["default"]


def test_collection_layout_and_hnsw_config(store: ChromaMemoryStore, info: ModelInfo) -> None:
    store.put(fake_memory(info, namespace="team a/β"))
    name = collection_name(info.fingerprint, "input", "team a/β")
    col = store.client.get_collection(name, embedding_function=None)
    assert col.configuration["hnsw"]["space"] == "cosine"
    assert col.configuration["hnsw"]["ef_search"] == store.hnsw_settings("input")["ef_search"]
    assert col.metadata["namespace"] == "team a/β" and col.metadata["dim"] == HIDDEN
    assert 3 <= len(name) <= 63
    store.put(fake_memory(info, keys={"kv": torch.randn(8)}, seed=5))
    kv = store.client.get_collection(collection_name(info.fingerprint, "kv", "default"), embedding_function=None)
    assert kv.configuration["hnsw"]["max_neighbors"] == 32 and kv.configuration["hnsw"]["ef_search"] == 800


def test_reopen_applies_mutable_hnsw_settings(tmp_path: Path, info: ModelInfo) -> None:
    ChromaMemoryStore(tmp_path / "s", model=info).put(fake_memory(info))
    tuned = ChromaMemoryStore(tmp_path / "s", model=info, hnsw={"ef_search": 37})
    assert len(tuned.query("input", torch.randn(HIDDEN), "default")) == 1
    col = tuned.client.get_collection(collection_name(info.fingerprint, "input", "default"), embedding_function=None)
    assert col.configuration["hnsw"]["ef_search"] == 37
    with pytest.raises(StoreError, match="cosine"):
        ChromaMemoryStore(tmp_path / "s", hnsw={"space": "l2"})


def test_query_scores_are_cosines(store: ChromaMemoryStore, info: ModelInfo) -> None:
    mems = [fake_memory(info, seed=i) for i in range(20)]
    store.put_many(mems)
    q = torch.randn(HIDDEN)
    hits = store.query("input", q, "default", k=20)
    keys = torch.stack([m.keys["input"] for m in mems]).double()
    cos = torch.nn.functional.cosine_similarity(keys, q.double()[None], dim=1)
    expect = sorted(range(20), key=lambda i: -cos[i])
    assert [h.record.id for h in hits] == [mems[i].id for i in expect]
    assert np.allclose([h.score for h in hits], cos[expect].numpy(), atol=1e-5)


def test_namespace_isolation(store: ChromaMemoryStore, info: ModelInfo) -> None:
    key = torch.randn(HIDDEN)
    a = fake_memory(info, "alice", keys={"input": key.clone()}, seed=1)
    b = fake_memory(info, "bob", keys={"input": key.clone()}, seed=2)
    store.put_many([a, b])
    for ns, own in (("alice", a), ("bob", b)):
        hits = store.query("input", key, ns, k=10)
        assert [h.record.id for h in hits] == [own.id] and hits[0].record.namespace == ns
    assert store.query("input", key, "carol", k=10) == []
    assert [r.id for r in store.list("alice")] == [a.id]
    with pytest.raises(MemoryNotFoundError):
        store.get(b.id, namespace="alice")
    assert not store.delete(b.id, namespace="alice") and store.count("bob") == 1


def test_refuses_memory_of_another_model(store: ChromaMemoryStore, info: ModelInfo) -> None:
    wider = fake_memory(fake_model_info(hidden=16, name="bigger"))
    with pytest.raises(IncompatibleMemoryError, match="hidden size 16"):
        store.put(wider)
    other_fp = fake_memory(fake_model_info(fingerprint="ffffffffffffffff", name="other"))
    with pytest.raises(IncompatibleMemoryError, match="fingerprint"):
        store.put(other_fp)
    assert store.count() == 0 and list(store.blobs) == []


def test_unbound_store_files_by_model_and_checks_dims(tmp_path: Path, info: ModelInfo) -> None:
    s = ChromaMemoryStore(tmp_path / "s")
    s.put(fake_memory(info))
    s.put(fake_memory(fake_model_info(hidden=16, fingerprint="ffffffffffffffff"), seed=3))
    assert s.count() == 2
    assert ChromaMemoryStore(tmp_path / "s", model=info).count() == 1
    with pytest.raises(StoreError, match="not bound"):
        s.query("input", torch.randn(HIDDEN), "default")
    bad = fake_memory(info, keys={"input": torch.randn(HIDDEN + 1)}, seed=4)
    with pytest.raises(StoreError, match="dimensions"):
        s.put(bad)
    assert len(list(s.blobs)) == 2 and s.check().ok  # refused before anything was written
    with pytest.raises(StoreError, match="dimensions"):
        ChromaMemoryStore(tmp_path / "s", model=info).query("input", torch.randn(3), "default")


def test_memory_without_keys_or_bad_namespace_refused(store: ChromaMemoryStore, info: ModelInfo) -> None:
    with pytest.raises(StoreError, match="no retrieval keys"):
        store.put(fake_memory(info, keys={}))
    with pytest.raises(StoreError, match="namespace"):
        store.query("input", torch.randn(HIDDEN), "")


def test_get_validates_blob(store: ChromaMemoryStore, info: ModelInfo) -> None:
    m = fake_memory(info)
    sha = store.put(m)
    path = store.blobs.path(sha)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MemoryFormatError):
        store.get(m.id)
    report = store.check(deep=True)
    assert report.corrupt_blobs == [sha]
    path.unlink()
    with pytest.raises(MissingBlobError):
        store.get(m.id)


def test_usage_counter_and_delete(store: ChromaMemoryStore, info: ModelInfo) -> None:
    m = fake_memory(info)
    store.put(m)
    store.record_usage("input", "default", [m.id])
    store.record_usage("input", "default", [m.id, m.id])  # one retrieval counts once
    [rec] = store.list()
    assert rec.usage == 2 and rec.last_used_at > 0
    store.put(m)  # re-put keeps the counter
    assert store.list()[0].usage == 2
    assert store.delete(m.id)
    assert store.count() == 0 and list(store.blobs) == []
    with pytest.raises(MemoryNotFoundError):
        store.get(m.id)


def test_reput_with_new_keys_replaces_blob_and_rows(store: ChromaMemoryStore, info: ModelInfo) -> None:
    m = fake_memory(info, keys={"input": torch.randn(HIDDEN), "kv": torch.randn(8)})
    old = store.put(m)
    m.keys = {"input": torch.randn(HIDDEN)}
    new = store.put(m)
    assert old != new and list(store.blobs) == [new]
    assert store.count(kind="kv") == 0 and store.check().ok


# ---- crash safety ------------------------------------------------------------------------


def _crash_on_call(monkeypatch: pytest.MonkeyPatch, store: ChromaMemoryStore, method: str, n: int) -> None:
    """Make ``store.<method>`` raise on its n-th call (1-based), as a killed process would stop there."""
    real = getattr(store, method)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, method, wrapper)


def test_crash_between_blob_and_rows_is_repaired(store: ChromaMemoryStore, info: ModelInfo, monkeypatch) -> None:
    m = fake_memory(info)
    _crash_on_call(monkeypatch, store, "_upsert_rows", 1)
    with pytest.raises(RuntimeError):
        store.put(m)
    monkeypatch.undo()
    assert store.count() == 0 and len(list(store.blobs)) == 1
    report = store.check()
    assert report.reindexed == [m.id] and not report.ok
    assert store.count() == 0  # check without repair changes nothing
    assert store.check(repair=True).reindexed == [m.id]
    assert store.check().ok
    assert [h.record.id for h in store.query("input", m.keys["input"], "default")] == [m.id]


def test_crash_between_rows_of_two_kinds_is_repaired(store: ChromaMemoryStore, info: ModelInfo, monkeypatch) -> None:
    m = fake_memory(info, keys={"input": torch.randn(HIDDEN), "kv": torch.randn(8)})
    _crash_on_call(monkeypatch, store, "_upsert_rows", 2)
    with pytest.raises(RuntimeError):
        store.put(m)
    monkeypatch.undo()
    assert store.count(kind="input") + store.count(kind="kv") == 1
    assert store.check(repair=True).reindexed == [m.id]
    assert store.count(kind="input") == 1 and store.count(kind="kv") == 1 and store.check().ok


def test_crash_between_journal_and_row_delete_is_repaired(store: ChromaMemoryStore, info: ModelInfo, monkeypatch):
    # delete order: journal -> rows -> blob; a crash before the rows go leaves the memory whole, journalled
    m, keep = fake_memory(info, seed=1), fake_memory(info, seed=2)
    store.put_many([m, keep])
    _crash_on_call(monkeypatch, store, "_delete_rows", 1)
    with pytest.raises(RuntimeError):
        store.delete(m.id)
    monkeypatch.undo()
    report = store.check()
    assert report.pending_deletes == [f"default/{m.id}"] and report.orphan_rows == [] and not report.ok
    assert all(store.blobs.exists(r.blob) for r in store.list())  # never a row without its blob
    store.check(repair=True)
    assert [r.id for r in store.list()] == [keep.id] and store.check().ok and len(list(store.blobs)) == 1


def test_crash_before_superseded_blob_removal_is_repaired(store: ChromaMemoryStore, info: ModelInfo, monkeypatch):
    m = fake_memory(info)
    old = store.put(m)
    m.keys = {"input": torch.randn(HIDDEN)}
    monkeypatch.setattr(store.blobs, "delete", lambda sha: (_ for _ in ()).throw(RuntimeError("simulated crash")))
    with pytest.raises(RuntimeError):
        store.put(m)
    monkeypatch.undo()
    report = store.check(repair=True)
    assert report.superseded_blobs == [old] and not store.blobs.exists(old)
    got = store.get(m.id)
    assert torch.equal(got.keys["input"], m.keys["input"]) and store.check().ok


def test_check_removes_stale_temp_files_but_not_young_ones(store: ChromaMemoryStore, info: ModelInfo) -> None:
    sha = store.put(fake_memory(info))
    leftover = store.blobs.path(sha).parent / ".tmp-deadbeef.safetensors"
    leftover.write_bytes(b"partial")
    assert store.check().ok  # younger than the grace period: maybe a live writer
    report = store.check(repair=True, temp_grace_seconds=0)
    assert report.temp_files == [str(leftover)] and not leftover.exists()


# ---- CLI --------------------------------------------------------------------------------


def test_cli_list_show_export_import_delete_check(tmp_path: Path, info: ModelInfo) -> None:
    root = tmp_path / "store"
    store = ChromaMemoryStore(root, model=info)
    a, b = fake_memory(info, "ns1", seed=1), fake_memory(info, "ns2", seed=2)
    store.put_many([a, b])
    run = CliRunner().invoke
    res = run(memories_app, ["list", "--store", str(root), "--json"])
    assert res.exit_code == 0, res.output
    assert {r["id"] for r in json.loads(res.stdout)} == {a.id, b.id}
    res = run(memories_app, ["list", "--store", str(root), "--namespace", "ns1", "--json"])
    assert [r["id"] for r in json.loads(res.stdout)] == [a.id]
    res = run(memories_app, ["show", a.id, "--store", str(root), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["soft_prompt"]["shape"] == [4, HIDDEN]
    out = tmp_path / "a.safetensors"
    assert run(memories_app, ["export", str(out), "--id", a.id, "--store", str(root)]).exit_code == 0
    assert LatentMemory.load(out).soft_prompt.numpy().tobytes() == a.soft_prompt.numpy().tobytes()
    res = run(memories_app, ["delete", a.id, "--store", str(root)])
    assert res.exit_code == 0 and store.count() == 1
    res = run(memories_app, ["delete", a.id, "--store", str(root)])
    assert res.exit_code == 2 and "error: no memory" in res.output
    assert run(memories_app, ["import", str(out), "--store", str(root)]).exit_code == 0
    assert store.count() == 2
    store.blobs.delete(store.put(b))  # lose a blob
    res = run(memories_app, ["check", "--store", str(root), "--json"])
    assert res.exit_code == 1 and len(json.loads(res.stdout)["orphan_rows"]) == 1
    assert run(memories_app, ["check", "--store", str(root), "--repair"]).exit_code == 0
    assert run(memories_app, ["check", "--store", str(root)]).exit_code == 0
    res = run(memories_app, ["list", "--store", str(tmp_path / "nothing")])
    assert res.exit_code == 2 and "no memory store" in res.output


def test_cli_tables_show_short_ids_under_a_header_and_take_unique_prefixes(tmp_path: Path, info: ModelInfo) -> None:
    root = tmp_path / "store"
    store = ChromaMemoryStore(root, model=info)
    a = fake_memory(info, "ns1", seed=1, memory_id="abcd" + "1" * 28)
    b = fake_memory(info, "ns2", seed=2, memory_id="abcd" + "2" * 28)
    c = fake_memory(info, "ns2", seed=3, memory_id="abcd" + "2" * 12 + "3" * 16)  # b's first 16 characters
    store.put_many([a, b, c])
    run = CliRunner().invoke
    for command in ("list", "stats"):
        res = run(memories_app, [command, "--store", str(root)])
        assert res.exit_code == 0, res.output
        header, *rows = res.stdout.splitlines()
        assert header.split()[:2] == ["id", "namespace"] and len(rows) == 3
        assert sorted(row[:14] for row in rows) == sorted(f"{m.id[:12]}  " for m in (a, b, c))
        assert not any(m.id in res.stdout for m in (a, b, c))  # only --json prints whole ids
    res = run(memories_app, ["list", "--store", str(root), "--json"])
    assert {r["id"] for r in json.loads(res.stdout)} == {a.id, b.id, c.id}
    res = run(memories_app, ["streams", "--store", str(root)])  # no stream memory: the header alone
    assert res.exit_code == 0 and res.stdout.split()[:3] == ["namespace", "version", "kind"]
    res = run(memories_app, ["show", "ABCD1", "--store", str(root), "--json"])  # a unique prefix, any case
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["record"]["id"] == a.id
    res = run(memories_app, ["show", "abcd", "--store", str(root)])
    assert res.exit_code == 2 and "is ambiguous: 3 memories start with it" in res.output
    # b and c agree on 16 characters: the error shows them long enough to tell apart
    assert f"{b.id[:17]} in 'ns2'" in res.output and f"{c.id[:17]} in 'ns2'" in res.output
    assert f"{a.id[:12]} in 'ns1'" in res.output and len(res.output.strip().splitlines()) == 1
    res = run(memories_app, ["show", "abcd2222", "--store", str(root), "--namespace", "ns1"])
    assert res.exit_code == 2 and "no memory 'abcd2222' in namespace 'ns1'" in res.output
    res = run(memories_app, ["show", "abc", "--store", str(root)])
    assert res.exit_code == 2 and "first 4 or more hex characters" in res.output
    res = run(memories_app, ["delete", "abcd2", "abcd1", "--store", str(root)])  # abcd2: b or c
    assert res.exit_code == 2 and "ambiguous" in res.output and store.count() == 3  # nothing deleted
    out = tmp_path / "c.safetensors"
    res = run(memories_app, ["export", c.id[:17], str(out), "--store", str(root), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["written"] == [str(out)] and LatentMemory.load(out).id == c.id
    res = run(memories_app, ["delete", c.id[:17], "abcd1", "feed", "--store", str(root), "--json"])
    assert res.exit_code == 2 and "no memory 'feed'" in res.output
    assert json.loads(res.stdout) == {"deleted": [c.id, a.id], "missing": ["feed"]}
    assert [r.id for r in store.list()] == [b.id]
    assert store.resolve_ids(["abcd", b.id], missing_ok=True) == [b.id, b.id]
    assert store.resolve_ids(["0000"], missing_ok=True) == [None]
    with pytest.raises(MemoryNotFoundError, match="no memory id starts with it"):
        store.resolve_id("0000")


def test_an_ambiguous_prefix_is_a_typed_error_naming_every_match() -> None:
    ids = [f"{i:x}" * 32 for i in range(1, 4)] + ["1" * 4 + "a" * 28, "1" * 32 + "f" * 32]
    candidates = [(mid, "ns") for mid in ids] + [(ids[0], "ns")]  # one id per key kind: counted once
    with pytest.raises(AmbiguousMemoryIdError) as err:
        match_prefixes(["1111"], candidates)
    assert err.value.matches == sorted([ids[0], ids[3], ids[4]]) and isinstance(err.value, StoreError)
    assert "3 memories start with it" in str(err.value)
    assert match_prefixes(["1" * 32], candidates) == {"1" * 32: ids[0]}  # an exact id wins over a longer one
    assert match_prefixes(["2222", "9999"], candidates) == {"2222": ids[1]}


def test_memories_help_has_no_markup() -> None:
    group = typer.main.get_command(memories_app)
    run = CliRunner().invoke
    pages = {"": run(memories_app, ["--help"], terminal_width=100)}
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        pages[name] = run(memories_app, [name, "--help"], terminal_width=100)
        # the command list shows a docstring's first paragraph as it is written: one line, or it breaks there
        assert "\n" not in inspect.cleandoc(command.help or "").split("\n\n")[0], name
    assert len(pages) == 12
    for name, res in pages.items():
        assert res.exit_code == 0, (name, res.output)
        for markup in ("`", ":class:", ":meth:", ":func:", ":mod:", "**"):
            assert markup not in res.output, (name, markup, res.output)


# ---- Chroma server (HttpClient) -------------------------------------------------------------


@pytest.fixture
def chroma_server(tmp_path: Path):
    with real_chroma_server(tmp_path / "chroma") as url:
        yield url


def test_http_client_against_real_chroma_server(chroma_server: str, tmp_path: Path, info: ModelInfo, monkeypatch):
    store = ChromaMemoryStore(tmp_path / "blobs-here", url=chroma_server, model=info)
    assert not (tmp_path / "blobs-here" / "chroma").exists()  # rows live in the server
    mems = [fake_memory(info, "srv", seed=i) for i in range(5)]
    store.put_many(mems)
    hit = store.query("input", mems[3].keys["input"], "srv", k=1)[0]
    assert hit.record.id == mems[3].id and hit.score == pytest.approx(1.0, abs=1e-5)
    assert store.query("input", mems[3].keys["input"], "other", k=1) == []
    assert torch.equal(store.get(mems[3].id).soft_prompt, mems[3].soft_prompt)
    store.record_usage("input", "srv", [mems[3].id])
    assert {r.id: r.usage for r in store.list()}[mems[3].id] == 1
    m = fake_memory(info, "srv", seed=99)
    _crash_on_call(monkeypatch, store, "_upsert_rows", 1)
    with pytest.raises(RuntimeError):
        store.put(m)
    monkeypatch.undo()
    assert store.check(repair=True).reindexed == [m.id] and store.count() == 6 and store.check().ok


def test_unreachable_server_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="Chroma server"):
        ChromaMemoryStore(tmp_path, url=f"http://127.0.0.1:{free_port()}")


def test_hnsw_overrides_come_from_the_config(tmp_path):
    from elm_memory.config import StoreConfig
    from elm_memory.store.chroma import ChromaMemoryStore

    store = ChromaMemoryStore.from_config(StoreConfig(path=str(tmp_path / "s"), hnsw={"ef_search": 123}))
    assert store.hnsw_settings("input")["ef_search"] == 123
    assert store.hnsw_settings("kv")["ef_search"] == 123  # an explicit setting beats the per-kind default
    assert ChromaMemoryStore.from_config(StoreConfig(path=str(tmp_path / "t"))).hnsw_settings("kv")["ef_search"] == 800
