"""Memory learner: sync/background/off modes, the durable queue, idempotency, crash resume.

No model: ``learn_fn`` is a fake that sleeps and writes into a thread-safe dict "store".
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from elm_memory.errors import ConfigError, InvalidQuestionError
from elm_memory.jobs import (
    BackgroundLearner,
    JobQueue,
    LearnerError,
    LearnJob,
    MemoryLearner,
    NoLearner,
    SyncLearner,
    build_learner,
    make_job_id,
    owner_is_alive,
    ticket_summary,
)
from elm_memory.jobs.owners import new_owner


class FakeStore:
    """Thread-safe stand-in for learn_fn + MemoryStore; the memory id is the job id."""

    def __init__(self, delay: float = 0.0, fail_times: int = 0, fail_always: bool = False):
        self.delay = delay
        self.fail_times = fail_times
        self.fail_always = fail_always
        self.lock = threading.Lock()
        self.memories: dict[str, str] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.active = 0
        self.max_active = 0

    def __call__(self, job: LearnJob) -> str:
        with self.lock:
            self.calls[job.job_id] += 1
            n = self.calls[job.job_id]
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay)
            if self.fail_always or n <= self.fail_times:
                raise RuntimeError(f"boom {n}")
            with self.lock:
                self.memories[job.job_id] = job.question  # upsert by job id: idempotent
            return job.job_id
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def qpath(tmp_path: Path) -> Path:
    return tmp_path / "store" / "learner.sqlite3"


# ---- jobs and the queue ---------------------------------------------------------------


def test_job_id_is_deterministic_and_json_roundtrips():
    a = LearnJob.create("What is 2+2?", "ns", config_overrides={"training": {"steps": 2}})
    assert a.job_id == make_job_id("  What is 2+2?\n", "ns")  # stripped question, same id
    assert a.job_id != make_job_id("What is 2+2?", "other")
    assert a.job_id != make_job_id("What is 2+2?", "ns", scope="model-b")
    assert LearnJob.from_json(a.to_json()) == a
    assert json.loads(a.to_json())["config_overrides"] == {"training": {"steps": 2}}
    with pytest.raises(InvalidQuestionError):
        LearnJob.create("   ", "ns")
    with pytest.raises(LearnerError):
        LearnJob.create("q", "ns", config_overrides={"x": object()})


def test_queue_states_claim_and_counts(qpath: Path):
    with JobQueue(qpath, max_attempts=2) as q:
        j1, j2 = LearnJob.create("a", "ns"), LearnJob.create("b", "ns")
        assert q.add(j1)[1] and q.add(j2)[1]
        assert q.add(LearnJob.create("a", "ns"))[1] is False  # same id: not inserted
        assert q.counts() == {"pending": 2, "running": 0, "done": 0, "failed": 0}
        rec = q.claim("me")
        assert rec.job_id == j1.job_id and rec.state == "running" and rec.job.attempts == 1  # FIFO
        assert q.complete(rec.job_id, "someone-else", "m") is False  # only the owner records
        assert q.complete(rec.job_id, "me", "mem-1")
        assert q.get(j1.job_id).memory_id == "mem-1"
        rec = q.claim("me")
        assert q.fail(rec.job_id, "me", "E1").state == "pending"
        rec = q.claim("me")
        after = q.fail(rec.job_id, "me", "E2")
        assert after.state == "failed" and after.error == "E2" and after.job.attempts == 2
        assert q.claim("me") is None
        assert [r.job_id for r in q.list("done")] == [j1.job_id]
        assert q.counts() == {"pending": 0, "running": 0, "done": 1, "failed": 1}
        with pytest.raises(LearnerError):
            q.list("bogus")  # type: ignore[arg-type]
    with pytest.raises(LearnerError, match="closed"):
        q.counts()


# ---- modes ----------------------------------------------------------------------------


def test_sync_learns_before_submit_returns(qpath: Path):
    store = FakeStore(delay=0.05)
    with build_learner("sync", store, qpath) as learner:
        assert isinstance(learner, SyncLearner) and isinstance(learner, MemoryLearner)
        t = learner.submit("q1", "ns")
        assert t.status == "done" and t.memory_id == t.job_id
        assert store.memories == {t.job_id: "q1"}  # stored before submit returned
        assert learner.job(t.job_id).state == "done"
        assert learner.submit("q1", "ns").duplicate  # no rerun
        assert store.calls[t.job_id] == 1
        assert learner.wait() is True


def test_sync_retries_then_reports_failure(qpath: Path):
    store = FakeStore(fail_times=1)
    with build_learner("sync", store, qpath) as learner:
        assert learner.submit("flaky").status == "done"  # attempt 2 succeeded inline
    store = FakeStore(fail_always=True)
    with build_learner("sync", store, qpath, max_attempts=2) as learner:
        t = learner.submit("hopeless")
        assert t.status == "failed" and "RuntimeError: boom 2" in t.error and t.attempts == 2


def test_background_submit_returns_immediately(qpath: Path):
    store = FakeStore(delay=0.5)
    with build_learner("background", store, qpath) as learner:
        assert isinstance(learner, BackgroundLearner)
        t0 = time.perf_counter()
        tickets = [learner.submit(f"q{i}") for i in range(2)]
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.05 * len(tickets), f"submit blocked for {elapsed:.3f}s"
        assert tickets[0].status == "pending" and store.memories == {}
        assert learner.wait(tickets[0].job_id, timeout=5)
        assert learner.ticket(tickets[0].job_id).memory_id == tickets[0].job_id
        assert learner.wait(timeout=5)
    assert len(store.memories) == 2


def test_16_concurrent_submits_each_stored_once(qpath: Path):
    store = FakeStore(delay=0.01)
    barrier = threading.Barrier(16)
    tickets: list = [None] * 16
    durations: list[float] = [0.0] * 16
    with build_learner("background", store, qpath) as learner:

        def client(i: int) -> None:
            barrier.wait()
            t0 = time.perf_counter()
            tickets[i] = learner.submit(f"question {i}", "ns")
            durations[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert learner.wait(timeout=10)
        assert learner.status()["done"] == 16
    assert all(t is not None and t.status == "pending" for t in tickets)
    assert len({t.job_id for t in tickets}) == 16
    assert len(store.memories) == 16 and set(store.calls.values()) == {1}
    assert store.max_active == 1  # one worker: learning jobs never overlap
    assert max(durations) < 1.0  # nobody waited for learning


def test_duplicate_submit_runs_once(qpath: Path):
    store = FakeStore(delay=0.2)
    with build_learner("background", store, qpath) as learner:
        first = learner.submit("same question", "ns")
        again = [learner.submit(" same question ", "ns") for _ in range(3)]  # pending/running
        assert all(t.job_id == first.job_id and t.duplicate for t in again)
        assert learner.wait(first.job_id, timeout=5)
        done = learner.submit("same question", "ns")
        assert done.status == "done" and done.memory_id == first.job_id and done.duplicate
        other_ns = learner.submit("same question", "other")
        assert other_ns.job_id != first.job_id and not other_ns.duplicate
        assert learner.wait(timeout=5)
    assert store.calls[first.job_id] == 1 and len(store.memories) == 2
    with build_learner("background", store, qpath) as learner:  # a restart does not rerun done jobs
        assert learner.submit("same question", "ns").status == "done"
    assert store.calls[first.job_id] == 1


@pytest.mark.parametrize("mode", ["sync", "background"])
def test_a_repeated_question_says_it_reused_its_memory(qpath: Path, mode: str, caplog: pytest.LogCaptureFixture):
    store = FakeStore()
    with build_learner(mode, store, qpath) as learner:
        first = learner.submit("What is 2+2?", "ns")
        assert learner.wait(first.job_id, timeout=5)
        assert not first.reused and ticket_summary(first)["reused"] is False
        with caplog.at_level(logging.INFO, logger="elm_memory.jobs"):
            again = learner.submit(" What is 2+2? ", "ns")
    assert again.reused and again.memory_id == first.job_id and store.calls[first.job_id] == 1
    assert ticket_summary(again) == {
        "job_id": first.job_id,
        "status": "done",
        "memory_id": first.job_id,
        "duplicate": True,
        "reused": True,
    }
    [line] = [r.getMessage() for r in caplog.records if "already learned" in r.getMessage()]
    assert line == (
        f"question already learned in namespace 'ns' (job {first.job_id[:12]}): reusing memory "
        f"{first.job_id[:12]}, no new memory learned"
    )


def test_failing_job_ends_failed_and_worker_survives(qpath: Path):
    store = FakeStore(fail_always=True)
    with build_learner("background", store, qpath, max_attempts=3) as learner:
        t = learner.submit("always fails")
        assert learner.wait(t.job_id, timeout=5)
        rec = learner.job(t.job_id)
        assert rec.state == "failed" and rec.job.attempts == 3 and rec.error == "RuntimeError: boom 3"
        assert store.calls[t.job_id] == 3
        assert learner.status()["worker_alive"]
        store.fail_always = False
        again = learner.submit("always fails")  # resubmitting a failed job queues it again
        assert again.status == "pending" and again.attempts == 0
        assert learner.wait(t.job_id, timeout=5) and learner.job(t.job_id).state == "done"


class SimulatedDeath(BaseException):
    """Stands in for the worker being torn down mid-job (not an ordinary failure)."""


def test_worker_death_resumes_in_a_new_learner(qpath: Path):
    calls = collections.Counter()

    def dying(job: LearnJob) -> str:
        calls[job.job_id] += 1
        raise SimulatedDeath

    learner = BackgroundLearner(dying, qpath, poll_interval=0.05)
    t = learner.submit("q")
    deadline = time.monotonic() + 5
    while learner.status()["worker_alive"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not learner.status()["worker_alive"]
    rec = learner.job(t.job_id)
    assert rec.state == "pending" and rec.job.attempts == 0  # released, attempt not counted
    learner.close(wait=False)

    store = FakeStore()
    with BackgroundLearner(store, qpath) as fresh:
        assert fresh.wait(t.job_id, timeout=5)
        assert fresh.job(t.job_id).state == "done"
    assert calls[t.job_id] == 1 and store.calls[t.job_id] == 1


def test_worker_restarts_itself_after_death(qpath: Path):
    died = threading.Event()
    store = FakeStore()

    def fn(job: LearnJob) -> str:
        if not died.is_set():
            died.set()
            raise SimulatedDeath
        return store(job)

    with BackgroundLearner(fn, qpath, poll_interval=0.05) as learner:
        t = learner.submit("q")
        assert died.wait(5)
        assert learner.wait(t.job_id, timeout=5)  # wait() notices the dead worker, restarts it
        assert learner.job(t.job_id).state == "done"


def test_stale_running_job_is_resumed_by_next_learner(qpath: Path):
    """A job left `running` by a worker that is gone (here: an owner token no live worker
    of this process holds) goes back to pending and completes exactly once."""
    with JobQueue(qpath) as q:
        job = LearnJob.create("q", "ns")
        q.add(job)
        q.add(LearnJob.create("q2", "ns"))
        dead_owner = new_owner()  # never registered as live
        assert q.claim(dead_owner).job_id == job.job_id
    store = FakeStore()
    with BackgroundLearner(store, qpath) as learner:
        assert learner.wait(timeout=5)
        rec = learner.job(job.job_id)
        assert rec.state == "done" and rec.job.attempts == 2
    assert set(store.calls.values()) == {1} and len(store.memories) == 2


def test_live_running_job_is_not_stolen(qpath: Path):
    """close(wait=False) mid-job: the old worker still holds the job; a new learner on the
    same queue must not run it a second time, but does run the rest."""
    release = threading.Event()
    store = FakeStore()

    def slow(job: LearnJob) -> str:
        if job.question == "slow":
            assert release.wait(10)
        return store(job)

    old = BackgroundLearner(slow, qpath, poll_interval=0.05)
    t = old.submit("slow")
    deadline = time.monotonic() + 5
    while old.job(t.job_id).state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    old.close(wait=False)
    with BackgroundLearner(store, qpath, poll_interval=0.05) as new:
        other = new.submit("fast")
        assert new.wait(other.job_id, timeout=5)
        assert new.job(t.job_id).state == "running"  # still the old worker's
        release.set()
        assert new.wait(t.job_id, timeout=5)
    assert store.calls[t.job_id] == 1 and len(store.memories) == 2


def test_job_that_keeps_killing_its_worker_ends_failed(qpath: Path):
    with JobQueue(qpath, max_attempts=2) as q:
        job = LearnJob.create("poison", "ns")
        q.add(job)
        for _ in range(2):
            q.claim(new_owner())
            q.recover()
        rec = q.get(job.job_id)
        assert rec.state == "failed" and "died during attempt 2" in rec.error


def test_sync_interrupt_releases_job_and_next_submit_resumes_it(qpath: Path):
    def interrupted(job: LearnJob) -> str:
        raise KeyboardInterrupt

    learner = SyncLearner(interrupted, qpath)
    with pytest.raises(KeyboardInterrupt):
        learner.submit("first")
    learner.close(wait=False)
    store = FakeStore()
    with SyncLearner(store, qpath) as fresh:
        assert fresh.status()["pending"] == 1
        second = fresh.submit("second")  # FIFO: the resumed job runs first
        assert second.status == "done"
        assert list(store.memories.values()) == ["first", "second"]


def test_off_mode_and_bad_mode(qpath: Path):
    learner = build_learner("off", None, None)
    assert isinstance(learner, NoLearner) and isinstance(learner, MemoryLearner)
    assert learner.submit("q").status == "skipped" and learner.wait()
    assert not qpath.exists()
    with pytest.raises(ConfigError):
        build_learner("later", FakeStore(), qpath)
    closed = build_learner("background", FakeStore(), qpath)
    closed.close()
    with pytest.raises(LearnerError, match="closed"):
        closed.submit("q")


# ---- a real process crash ------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from learner_markers import learn_with_markers
    from elm_memory.jobs import build_learner

    root = Path(sys.argv[1])
    learner = build_learner("background", learn_with_markers(root, die_on="q2"), root / "learner.sqlite3")
    for q in ("q1", "q2", "q3"):
        learner.submit(q, "ns")
    time.sleep(30)  # the worker os._exit()s the process while learning q2
    sys.exit(3)
    """
)

MARKERS = textwrap.dedent(
    """
    import os, time

    def learn_with_markers(root, die_on=None):
        def learn(job):
            (root / f"start-{job.question}-{os.getpid()}").touch()
            time.sleep(0.1)
            if job.question == die_on:
                os._exit(1)  # hard death mid-job: no cleanup, no finally
            with open(root / f"done-{job.question}", "a") as fh:
                fh.write(f"{os.getpid()}\\n")
            return job.job_id
        return learn
    """
)


def test_process_crash_mid_job_resumes_each_job_exactly_once(tmp_path: Path):
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "learner_markers.py").write_text(MARKERS)
    sys.path.insert(0, str(helpers))
    try:
        from learner_markers import learn_with_markers
    finally:
        sys.path.remove(str(helpers))
    root = tmp_path / "run"
    root.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(helpers)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 1, child.stderr
    with JobQueue(root / "learner.sqlite3") as q:
        states = {r.job.question: r.state for r in q.list()}
    assert states == {"q1": "done", "q2": "running", "q3": "pending"}  # died holding q2

    with build_learner("background", learn_with_markers(root), root / "learner.sqlite3") as learner:
        assert learner.wait(timeout=10)
        recs = {r.job.question: r for r in learner.queue.list()}
    assert {q: r.state for q, r in recs.items()} == {"q1": "done", "q2": "done", "q3": "done"}
    assert recs["q2"].job.attempts == 2 and recs["q1"].job.attempts == 1
    done = {q: (root / f"done-{q}").read_text().split() for q in ("q1", "q2", "q3")}
    assert all(len(pids) == 1 for pids in done.values()), done  # each job completed exactly once
    assert done["q1"] != [str(os.getpid())]  # learned by the child before it died, not rerun
    assert done["q2"] == done["q3"] == [str(os.getpid())]
    assert len(list(root.glob("start-q2-*"))) == 2  # started in the child, resumed here


def test_owner_on_another_host_is_judged_by_heartbeat(qpath: Path):
    with JobQueue(qpath, lease=60) as q:
        job = LearnJob.create("remote", "ns")
        q.add(job)
        remote = "some-other-host|4242||abcdef"
        assert owner_is_alive(remote) is None  # pids on another host mean nothing here
        q.claim(remote)
        assert q.recover() == 0  # fresh heartbeat: presumed alive
        with q._db() as conn:
            conn.execute("UPDATE jobs SET heartbeat_at = ? WHERE job_id = ?", (time.time() - 61, job.job_id))
        assert q.recover() == 1  # silent for longer than the lease: presumed dead
        assert q.get(job.job_id).state == "pending"


def test_running_job_heartbeats(qpath: Path):
    gate = threading.Event()
    q = JobQueue(qpath, lease=0.2)  # beats every 0.05 s

    def slow(job: LearnJob) -> str:
        gate.wait(5)
        return job.job_id

    with BackgroundLearner(slow, q) as learner:
        t = learner.submit("q")
        time.sleep(0.3)
        rec = learner.job(t.job_id)
        assert rec.state == "running"
        with q._db() as conn:
            beat = conn.execute("SELECT heartbeat_at FROM jobs WHERE job_id = ?", (t.job_id,)).fetchone()[0]
        assert time.time() - beat < 0.2
        gate.set()


def test_ray_dispatcher_gets_the_worker_factory_by_name(tmp_path: Path):
    # jobs never imports the facade: the answering side passes ELM down, and the dispatcher process
    # (a child started by the supervisor) finds it again from its MODULE:NAME on the command line
    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM
    from elm_memory.jobs import build_learner
    from elm_memory.jobs.ray_dispatch import DispatcherSupervisor

    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"path": str(tmp_path / "store")}})
    sup = DispatcherSupervisor(cfg, tmp_path / "ledger.sqlite3", worker_factory=ELM)
    try:
        assert sup.command()[-2:] == ["--worker-factory", "elm_memory.elm:ELM"]
    finally:
        sup.stop()
    auto = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"mode": "ray"})})
    assert auto.learner.ray.dispatcher == "auto"
    with pytest.raises(ConfigError, match="factory"):
        build_learner("ray", None, tmp_path / "ledger.sqlite3", config=auto)
