"""Namespace isolation at scale (#18 item 3): randomized retrievals across 20 namespaces that hold
the same questions with the same keys (the hardest case: the nearest key of another namespace is
identical), then the deletion of one namespace.

Every hit must belong to the namespace asked, be one of its memories and, when the question is
there, be its own memory first. Deleting one namespace must leave every other one byte-identical:
blobs, index rows (ids, embeddings, metadata), records and usage counters. The default run does
2,000 retrievals; the ``slow`` variant 10,000.
"""

from __future__ import annotations

import collections
import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _fakes import fake_memory, fake_model_info
from _reliability import report, row

from elm_memory.store.chroma import ChromaMemoryStore

NAMESPACES = [f"tenant-{i:02d}" for i in range(19)] + ["../tenant-00"]  # a name that looks like a path, too
POOL = [f"What is {a} + {b}?" for a, b in zip(range(40), range(40, 80), strict=True)]
PER_NAMESPACE = 25
HIDDEN = 16


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from report(request, ["isolation: retrievals", "isolation: retrievals (slow)"])


def question_key(question: str) -> torch.Tensor:
    """The same question gets the same key in every namespace."""
    seed = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16)
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def build(tmp_path: Path, rng: random.Random) -> tuple[ChromaMemoryStore, dict[str, dict[str, str]]]:
    """20 namespaces of 25 questions each, drawn from one pool of 40: ns -> question -> memory id."""
    info = fake_model_info(hidden=HIDDEN)
    s = ChromaMemoryStore(tmp_path / "store", model=info)
    held: dict[str, dict[str, str]] = {}
    for n, ns in enumerate(NAMESPACES):
        qs = rng.sample(POOL, PER_NAMESPACE)
        ms = [
            fake_memory(info, ns, n * 1000 + i, question=q, keys={"input": question_key(q)}) for i, q in enumerate(qs)
        ]
        s.put_many(ms)
        held[ns] = {m.meta.question: m.id for m in ms}
    return s, held


def snapshot(s: ChromaMemoryStore, namespace: str) -> dict:
    """Everything stored for ``namespace``, as bytes where it is bytes."""
    records = sorted((r.to_dict() for r in s.list(namespace)), key=lambda r: r["id"])
    rows = {}
    for info, col in s._collections(namespace=namespace, all_models=True):
        got = col.get(include=["embeddings", "metadatas"])
        order = np.argsort(got["ids"])
        rows[info.name] = [
            (got["ids"][i], np.asarray(got["embeddings"][i], dtype=np.float32).tobytes(), got["metadatas"][i])
            for i in order
        ]
    blobs = {r["blob"]: s.blobs.path(r["blob"]).read_bytes() for r in records}
    counters = {k: v for k, v in s.utility.get(namespace).items()}
    return {"records": records, "rows": rows, "blobs": blobs, "counters": counters}


def retrievals(tmp_path: Path, n: int, variant: str) -> None:
    tally = row(f"isolation: retrievals{variant}")
    rng = random.Random(18)
    s, held = build(tmp_path, rng)
    ids = {ns: set(q.values()) for ns, q in held.items()}
    used: collections.Counter[tuple[str, str]] = collections.Counter()
    cross = wrong_first = 0
    for _ in range(n):
        ns, q = rng.choice(NAMESPACES), rng.choice(POOL)
        key = question_key(q) + rng.choice([0.0, 0.01, 0.3]) * torch.randn(HIDDEN)
        hits = s.query("input", key, ns, k=rng.randint(1, 8))
        tally.inputs += 1
        cross += sum(1 for h in hits if h.record.namespace != ns or h.record.id not in ids[ns])
        if q in held[ns] and hits[0].record.id != held[ns][q]:
            wrong_first += 1
        if hits and rng.random() < 0.1:
            s.record_usage("input", ns, [hits[0].record.id])
            used[(ns, hits[0].record.id)] += 1
    tally.runs += 1
    tally.duplicated += cross  # a result from another namespace (none allowed)
    tally.note("own_memory_not_first", wrong_first)
    assert cross == 0, f"{cross} results from another namespace"
    assert wrong_first == 0  # identical keys elsewhere never outrank the namespace's own memory
    counted = {(ns, mid): u.usage for ns in NAMESPACES for (_, mid), u in s.utility.get(ns).items()}
    assert counted == dict(used)  # usage counted exactly, on the namespace's own memory

    # delete one namespace: every other one stays byte-identical, the deleted one leaves nothing
    victim = rng.choice(NAMESPACES)
    before = {ns: snapshot(s, ns) for ns in NAMESPACES if ns != victim}
    blob_files = {p.name: p.read_bytes() for p in (s.root / "blobs").rglob("*.safetensors")}
    victim_blobs = {f"{r.blob}.safetensors" for r in s.list(victim)}
    gone = s.delete_namespace(victim)
    assert sorted(gone) == sorted(ids[victim])
    after = {ns: snapshot(s, ns) for ns in NAMESPACES if ns != victim}
    changed = [ns for ns in before if before[ns] != after[ns]]
    tally.lost += len(changed)  # a namespace that lost or changed anything
    assert changed == []
    left = {p.name: p.read_bytes() for p in (s.root / "blobs").rglob("*.safetensors")}
    assert set(blob_files) - set(left) == victim_blobs  # exactly the victim's blobs went
    assert all(left[name] == blob_files[name] for name in left)
    assert s.list(victim) == [] and s.count(victim) == 0 and s.utility.get(victim) == {}
    assert not s._collections(namespace=victim, all_models=True)
    for q in rng.sample(POOL, 10):
        assert s.query("input", question_key(q), victim, k=5) == []
        tally.inputs += 1
    assert s.check().ok


def test_isolation_across_20_namespaces(tmp_path):
    retrievals(tmp_path, 2_000, "")


@pytest.mark.slow
def test_isolation_across_20_namespaces_10k(tmp_path):
    retrievals(tmp_path, 10_000, " (slow)")
