"""Fault injection at every write step (#18 item 1): a child process runs a random workload and is
killed with SIGKILL at a named fault point (elm_memory/faults.py) on a random pass; the parent then
checks the pool.

After each kill: ``check`` is clean, or ``check --repair`` makes it clean; every memory the child
was told was saved is there, readable, at the version it was told (the operation in flight at the
kill may have happened or not); nothing deleted comes back and no memory has two blobs; usage
counts are exact; every job whose submit returned is learned after a restart, each question once.

Which point and which pass: a calibration run (no fault, ``ELM_FAULT_TRACE``) counts each
point's passes; each run then draws a point the calibration passed, uniformly, and a pass in
1..count, from a seeded RNG (``ELM_FAULTS_SEED`` changes the seed). The default run does a few
runs per workload; the ``slow`` variants do 40 (store) and 20 (jobs).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _fakes import fake_model_info
from _faultload import MAX_MEMORIES, NAMESPACES, fake_kv_memory, job_memory_id, make_learn_fn, open_store, questions
from _reliability import report, row

from elm_memory import faults
from elm_memory.errors import ConfigError, ELMError
from elm_memory.jobs import build_learner

LOAD = Path(__file__).resolve().parent / "_faultload.py"
SEED = int(os.environ.get("ELM_FAULTS_SEED", "18"))


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from report(request, [f"faults: {w}{v}" for w in ("store writes", "learner jobs") for v in ("", " (slow)")])


def run_child(root: Path, kind: str, seed: int, fault: str | None = None, trace: Path | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.TRACE_ENV)}
    if fault:
        env[faults.ENV] = fault
    if trace:
        env[faults.TRACE_ENV] = str(trace)
    root.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, str(LOAD), kind, str(root), str(seed)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode in (0, -signal.SIGKILL), f"{kind} seed {seed} fault {fault}: {proc.stderr[-3000:]}"
    return proc.returncode


def calibrate(tmp: Path, kind: str) -> collections.Counter[str]:
    trace = tmp / f"trace-{kind}"
    assert run_child(tmp / f"calibrate-{kind}", kind, SEED, trace=trace) == 0
    return collections.Counter(trace.read_text().split())


def plans(tmp: Path, kind: str, runs: int) -> list[tuple[int, str]]:
    """(child seed, fault spec) per run: the points the calibration passed, in a shuffled cycle (so
    enough runs stop at every one), each at a random pass in 1..count."""
    passes = calibrate(tmp, kind)
    rng = random.Random(f"{SEED}-{kind}-{runs}")
    cycle: list[str] = []
    out = []
    for i in range(runs):
        if not cycle:
            cycle = sorted(passes)
            rng.shuffle(cycle)
        name = cycle.pop()
        out.append((SEED * 1000 + runs * 100 + i, f"{name}@{rng.randint(1, passes[name])}:kill"))
    return out


def ledger(root: Path) -> list[dict]:
    path = root / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def rows_without_blob(s) -> int:
    """Index rows naming a blob that is not on disk: never, even right after a kill (blobs go first on a
    put and last on a delete), because a reader would fail on them."""
    return sum(1 for r in s.list() if not s.blobs.exists(r.blob))


def consistent(s) -> bool:
    """``check`` clean, or made clean by ``check --repair``; True when a repair was needed."""
    if s.check(temp_grace_seconds=0).ok:
        return False
    s.check(repair=True, temp_grace_seconds=0)
    after = s.check(temp_grace_seconds=0)
    assert after.ok, after
    return True


# ---- store writes: put, re-put, usage, delete, eviction, namespace delete, memories import ----------------


def expected_store(entries: list[dict]) -> tuple[dict, dict]:
    """From the ledger: the versions each memory may have now ((ns, id) -> {sha or None}), and its usage
    counts ((ns, id) -> {count}). Finished operations are certain; the one in flight allows both outcomes."""
    saved: dict[tuple[str, str], str] = {}
    usage: collections.Counter[tuple[str, str]] = collections.Counter()
    begun = None
    for e in entries:
        if e["kind"] == "begin":
            begun = e
            continue
        assert begun is not None and e["step"] == begun["step"]
        ns = begun["ns"]
        absorbed = sum(usage[(ns, mid)] for mid in merged_counters(begun)[-1])
        for mid in begun.get("victims", []):
            saved.pop((ns, mid))
            usage.pop((ns, mid), None)
        for mid, sha in begun.get("shas", {}).items():
            saved[(ns, mid)] = sha
        if begun["op"] == "use":
            usage[(ns, begun["id"])] += 1
        if begun["op"] == "merge":  # the members' counters move to the merged memory
            usage[(ns, next(iter(begun["shas"])))] = absorbed
        begun = None
    versions: dict[tuple[str, str], set] = {k: {sha} for k, sha in saved.items()}
    counts: dict[tuple[str, str], set] = {k: {usage[k]} for k in saved}
    if begun is not None:  # killed during this operation
        ns = begun["ns"]
        for mid in begun.get("victims", []):
            versions[(ns, mid)].add(None)
            counts[(ns, mid)].add(0)
        for mid, sha in begun.get("shas", {}).items():
            versions.setdefault((ns, mid), {None}).add(sha)
            counts.setdefault((ns, mid), {0})
        if begun["op"] == "use":
            counts[(ns, begun["id"])].add(usage[(ns, begun["id"])] + 1)
        if begun["op"] == "merge":
            counts[(ns, next(iter(begun["shas"])))] |= {
                sum(usage[(ns, m)] for m in ms) for ms in merged_counters(begun)
            }
    return versions, counts


def merged_counters(begun: dict) -> list[list[str]]:
    """Whose counters a merged memory may hold: the members, less any that its own put evicted first
    (the eviction forgets their counters); the last entry is what a finished merge holds."""
    members = begun.get("members", [])
    evicted = [m for m in members if m in begun.get("evicted", [])]
    out = []
    for mask in range(2 ** len(evicted)):
        gone = {m for i, m in enumerate(evicted) if mask >> i & 1}
        out.append([m for m in members if m not in gone])
    return out


def check_store_run(root: Path) -> tuple[int, int, bool, int]:
    """(lost, duplicated, repaired, operations tried) of one killed store workload."""
    entries = ledger(root)
    versions, counts = expected_store(entries)
    s = open_store(root)
    lost = rows_without_blob(s)  # as the kill left it, before any repair
    repaired = consistent(s)
    records = {(r.namespace, r.id): r for r in s.list()}
    duplicated = 0
    for key in set(versions) | set(records):
        r = records.get(key)
        if key not in versions:
            duplicated += 1  # a memory nobody saved, or a deleted one come back
            continue
        if (r.blob if r else None) not in versions[key]:
            lost += 1
            continue
        if r is not None:
            m = s.load(r)  # readable, and the memory the row says (hash-checked)
            assert (m.meta.namespace, m.id) == key
            got = s.utility_of(key[0], [key[1]]).get(key[1])
            assert (got.usage if got else 0) in counts[key], (key, got, counts[key])
    duplicated += len(list(s.blobs)) - len(records)  # a memory with two blobs (check would also say so)
    # the pool takes writes again, with the same limits
    m = fake_kv_memory(fake_model_info(), NAMESPACES[0], 999, "f" * 32)
    s.put(m)
    assert s.get(m.id).id == m.id and s.check().ok and s.count(NAMESPACES[0]) <= MAX_MEMORIES
    ops = sum(1 for e in entries if e["kind"] == "begin")
    return lost, duplicated, repaired, ops


def fault_runs(
    tmp_path: Path,
    name: str,
    workload: str,
    runs: int,
    check: Callable[[Path, int], tuple[int, int, bool, int, dict[str, int]]],
) -> None:
    """``runs`` children of ``workload``, each killed at its planned point, then ``check``ed:
    (lost, duplicated, repaired, inputs, extra notes). Counted in the row ``name``; nothing lost or
    duplicated, and no error while checking."""
    tally = row(name)
    for seed, fault in plans(tmp_path, workload, runs):
        root = tmp_path / f"run-{seed}"
        rc = run_child(root, workload, seed, fault)
        try:
            lost, duplicated, repaired, inputs, notes = check(root, seed)
        except Exception as exc:
            tally.errors += 1
            tally.typed_errors += isinstance(exc, ELMError)
            raise
        tally.runs += 1
        tally.faults += rc == -signal.SIGKILL
        tally.inputs += inputs
        tally.lost += lost
        tally.duplicated += duplicated
        tally.note("repaired", repaired)
        for key, n in notes.items():
            tally.note(key, n)
        if rc == -signal.SIGKILL:
            tally.note(f"at {fault.split('@')[0]}")
        assert (lost, duplicated) == (0, 0), f"seed {seed}, {fault}: {lost} lost, {duplicated} duplicated"


def store_runs(tmp_path: Path, runs: int, variant: str = "") -> None:
    fault_runs(tmp_path, f"faults: store writes{variant}", "store", runs, lambda root, _: (*check_store_run(root), {}))


def test_store_writes_survive_kill_at_any_step(tmp_path):
    store_runs(tmp_path, 5)


@pytest.mark.slow
def test_store_writes_survive_kill_at_any_step_many(tmp_path):
    store_runs(tmp_path, 40, " (slow)")


# ---- learner jobs: submit, claim, learn (a put), complete, fail ---------------------------------------------


def check_jobs_run(root: Path, seed: int) -> tuple[int, int, bool, int]:
    """Restart the learner on the killed child's queue and store: (lost, duplicated, repaired, reruns)."""
    qs, fail_first = questions(seed)
    submitted = {e["question"]: e["job_id"] for e in ledger(root) if e["kind"] == "end"}
    s = open_store(root, max_memories=None)
    unreadable = rows_without_blob(s)  # as the kill left it, before any repair
    repaired = consistent(s)
    queue = root / "store" / "learner.sqlite3"
    with build_learner("background", make_learn_fn(root, s, fail_first), queue, poll_interval=0.05) as learner:
        assert learner.wait(timeout=60)  # what was queued before the kill, resumed with no new submit
        before = {r.job.question: r for r in learner.queue.list()}
        lost = unreadable + sum(1 for q in submitted if q not in before or before[q].state != "done")
        for q in qs:  # the client submits again what it never got a ticket for (and, harmlessly, the rest)
            learner.submit(q, "jobs")
        assert learner.wait(timeout=60)
        jobs = learner.queue.list()
    assert consistent(s) is False
    done = [r for r in jobs if r.state == "done"]
    assert len(done) == len(jobs) == len(qs), [(r.job.question, r.state, r.error) for r in jobs]
    by_question = collections.Counter(r.question for r in s.list("jobs"))
    duplicated = sum(n - 1 for n in by_question.values()) + len(jobs) - len({r.job.question for r in jobs})
    lost += sum(1 for q in qs if by_question[q] == 0)
    for r in jobs:
        assert r.memory_id == job_memory_id(r.job_id) and s.load(s.record(r.memory_id, "jobs")).meta.question == (
            r.job.question
        )
    runs = collections.Counter(
        json.loads(line)["question"] for line in (root / "learned.jsonl").read_text().splitlines()
    )
    reruns = sum(max(0, n - 1 - (q in fail_first)) for q, n in runs.items())  # learned again after a kill (idempotent)
    return lost, duplicated, repaired, reruns


def jobs_runs(tmp_path: Path, runs: int, variant: str = "") -> None:
    def check(root: Path, seed: int) -> tuple[int, int, bool, int, dict[str, int]]:
        lost, duplicated, repaired, reruns = check_jobs_run(root, seed)
        return lost, duplicated, repaired, len(questions(seed)[0]), {"rerun_jobs": reruns}

    fault_runs(tmp_path, f"faults: learner jobs{variant}", "jobs", runs, check)


def test_jobs_survive_kill_at_any_step(tmp_path):
    jobs_runs(tmp_path, 3)


@pytest.mark.slow
def test_jobs_survive_kill_at_any_step_many(tmp_path):
    jobs_runs(tmp_path, 20, " (slow)")


# ---- the hook itself ---------------------------------------------------------------------------------------


def test_fault_spec_and_in_process_raise(tmp_path):
    assert faults.parse(None) is None
    with pytest.raises(ConfigError, match="NAME@N:MODE"):
        faults.parse("blob.fsynced@0:kill")
    with pytest.raises(ConfigError, match="NAME@N:MODE"):
        faults.parse("blob.fsynced@1:explode")
    plan = faults.parse("blob.fsynced@2:raise")
    assert (plan.name, plan.nth, plan.mode) == ("blob.fsynced", 2, "raise")
    from elm_memory.store.blobs import BlobStore

    blobs = BlobStore(tmp_path / "blobs")
    previous = faults.arm(plan)
    try:
        blobs.put(b"one")
        with pytest.raises(faults.InjectedFault, match="blob.fsynced"):
            blobs.put(b"two")
    finally:
        faults.arm(previous)
    assert len(list(blobs)) == 1 and blobs.temp_files() == []  # the raise left no temp file behind
