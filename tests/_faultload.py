"""Workloads that tests/test_faults.py runs in a child process, which an armed fault point
(``ELM_FAULT``, see elm_memory/faults.py) kills with SIGKILL part-way.

``python tests/_faultload.py store|jobs ROOT SEED``. The child appends to ``ROOT/ledger.jsonl``
a ``begin`` line before each operation (what it may change) and an ``end`` line once it
returned (what the caller was told): the parent replays the ledger to know which memories
were reported saved and which jobs were submitted, then checks the store and queue.
The workloads use fake memories (tests/_fakes.py): the store and the queue need no model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fakes import fake_memory, fake_model_info  # noqa: E402

NAMESPACES = ("a", "b", "c")
MAX_MEMORIES = 5  # per namespace: puts past it evict (policy "oldest", predictable)
QUESTIONS = 8  # jobs per jobs workload


def fake_kv_memory(info: Any, namespace: str, seed: int, memory_id: str) -> Any:
    """A fake memory with two key kinds (two collections: a put writes rows in two batches)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1_000_003)
    keys = {"input": torch.randn(info.hidden_size, generator=g), "kv": torch.randn(8, generator=g)}
    return fake_memory(info, namespace, seed, keys=keys, memory_id=memory_id)


def open_store(root: Path, max_memories: int | None = MAX_MEMORIES) -> Any:
    from elm_memory.store.chroma import ChromaMemoryStore

    return ChromaMemoryStore(root / "store", model=fake_model_info(), max_memories=max_memories, eviction="oldest")


class Ledger:
    def __init__(self, path: Path):
        self.fh = path.open("a", encoding="utf-8")

    def write(self, **entry: Any) -> None:
        self.fh.write(json.dumps(entry) + "\n")
        self.fh.flush()  # in the page cache: survives a kill -9 of this process


def store_workload(root: Path, seed: int, n_ops: int = 14) -> None:
    """Random puts, re-puts, usage counts, deletes, evictions, merges, namespace deletes and CLI imports."""
    from elm_memory.cli.memories import memories_app
    from elm_memory.store.blobs import sha256_hex

    rng = random.Random(seed)
    info = fake_model_info()
    s = open_store(root)
    ledger = Ledger(root / "ledger.jsonl")
    live: dict[str, dict[str, tuple[float, str]]] = {ns: {} for ns in NAMESPACES}  # ns -> id -> (created, sha)

    def new_id() -> str:
        return f"{rng.getrandbits(128):032x}"

    def victims(ns: str, putting: dict[str, float]) -> list[str]:
        ids = set(live[ns]) | set(putting)
        excess = len(ids) - MAX_MEMORIES
        older = sorted((c, i) for i, (c, _) in live[ns].items() if i not in putting)
        return [i for _, i in older[: max(excess, 0)]]

    for step in range(n_ops):
        ns = rng.choice(NAMESPACES)
        ops = ["put", "reput", "use", "delete", "evict", "merge", "import", "delete_ns"]
        op = rng.choices(ops, [5, 2, 3, 2, 1, 2, 2, 1])[0]
        if op in ("reput", "use", "delete", "evict") and not live[ns] or op == "merge" and len(live[ns]) < 2:
            op = "put"
        if op in ("put", "reput", "import"):
            n_new = rng.randint(1, 3)
            ids = [rng.choice(sorted(live[ns]))] if op == "reput" else [new_id() for _ in range(n_new)]
            ms = [fake_kv_memory(info, ns, rng.getrandbits(31), i) for i in ids]
            shas = {m.id: sha256_hex(m.to_bytes()) for m in ms}
            created = {m.id: m.meta.created_at for m in ms}
            gone = victims(ns, created) if op != "import" else []  # the CLI's store has no max_memories
            old = {i: live[ns][i][1] for i in ids if i in live[ns]}
            ledger.write(kind="begin", op=op, ns=ns, shas=shas, old=old, victims=gone, step=step)
            if op == "import":
                folder = root / f"import-{step}"
                folder.mkdir()
                files = [str(m.save(folder / f"{m.id}.safetensors")) for m in ms]
                memories_app(["import", *files, "--store", str(root / "store")], standalone_mode=False)
            else:
                got = s.put_many(ms)
                assert got == [shas[m.id] for m in ms], (got, shas)
            for i in gone:
                live[ns].pop(i)
            for m in ms:
                live[ns][m.id] = (created[m.id], shas[m.id])
        elif op == "merge":  # members replaced by one memory naming them (merged_from), as merges.py commits it
            members = rng.sample(sorted(live[ns]), rng.randint(2, min(3, len(live[ns]))))
            m = fake_kv_memory(info, ns, rng.getrandbits(31), new_id())
            m.meta.merged_from, m.meta.merge_strategy = members, "average"
            sha = sha256_hex(m.to_bytes())
            evicted = victims(ns, {m.id: m.meta.created_at})  # the merged memory's put may evict, members too
            gone = sorted(set(evicted) | set(members))
            ledger.write(
                kind="begin", op=op, ns=ns, shas={m.id: sha}, victims=gone, members=members, evicted=evicted, step=step
            )
            assert sorted(s.commit_merge(m)) == sorted(members)
            for i in gone:
                live[ns].pop(i)
            live[ns][m.id] = (m.meta.created_at, sha)
        elif op == "use":
            mid = rng.choice(sorted(live[ns]))
            ledger.write(kind="begin", op=op, ns=ns, id=mid, step=step)
            s.record_usage("input", ns, [mid])
        elif op == "delete":
            mid = rng.choice(sorted(live[ns]))
            ledger.write(kind="begin", op=op, ns=ns, victims=[mid], step=step)
            assert s.delete(mid, ns)
            live[ns].pop(mid)
        elif op == "evict":
            keep = rng.randint(1, max(len(live[ns]) - 1, 1))
            older = sorted((c, i) for i, (c, _) in live[ns].items())
            gone = [i for _, i in older[: max(len(older) - keep, 0)]]
            ledger.write(kind="begin", op=op, ns=ns, victims=gone, step=step)
            assert sorted(s.evict("oldest", keep, ns)) == sorted(gone)
            for i in gone:
                live[ns].pop(i)
        else:  # delete_ns
            gone = sorted(live[ns])
            ledger.write(kind="begin", op=op, ns=ns, victims=gone, step=step)
            assert sorted(s.delete_namespace(ns)) == gone
            live[ns].clear()
        ledger.write(kind="end", step=step)
        # what the store says now is what the workload predicted (else exit 1: the parent fails the run)
        listed = {(r.namespace, r.id, r.blob) for r in s.list()}
        assert listed == {(n, i, sha) for n in NAMESPACES for i, (_, sha) in live[n].items()}, step


def job_memory_id(job_id: str) -> str:
    return job_id[:32]


def make_learn_fn(root: Path, store: Any, fail_first: set[str]) -> Any:
    """Learn a job: put its (fake) memory, id derived from the job id (a re-run overwrites it)."""
    info = fake_model_info()
    runs = Ledger(root / "learned.jsonl")

    def learn(job: Any) -> str:
        runs.write(question=job.question)
        if job.question in fail_first and job.attempts == 1:
            raise RuntimeError(f"first attempt of {job.question} fails")
        seed = int(job.job_id[:7], 16)
        m = fake_memory(info, job.namespace, seed, memory_id=job_memory_id(job.job_id), question=job.question)
        store.put(m)
        return m.id

    return learn


def questions(seed: int) -> tuple[list[str], set[str]]:
    rng = random.Random(seed)
    qs = [f"job question {seed}-{i}?" for i in range(QUESTIONS)]
    return qs, {q for q in qs if rng.random() < 0.25}


def jobs_workload(root: Path, seed: int) -> None:
    """A background learner drains submitted jobs (some fail their first attempt) into the store."""
    from elm_memory.jobs import build_learner

    qs, fail_first = questions(seed)
    s = open_store(root, max_memories=None)  # every learned memory stays
    ledger = Ledger(root / "ledger.jsonl")
    learner = build_learner(
        "background", make_learn_fn(root, s, fail_first), root / "store" / "learner.sqlite3", poll_interval=0.05
    )
    for q in qs:
        ledger.write(kind="begin", op="submit", question=q)
        ticket = learner.submit(q, "jobs")
        ledger.write(kind="end", op="submit", question=q, job_id=ticket.job_id)
    assert learner.wait(timeout=60)
    learner.close()


if __name__ == "__main__":
    kind, where, run_seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    {"store": store_workload, "jobs": jobs_workload}[kind](where, run_seed)
