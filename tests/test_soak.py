"""Soak (#18 item 4): 16 concurrent answerers on cpu-tiny (SmolLM2-135M) for a bounded time while a
separate learner process drains the durable queue; that learner is killed with SIGKILL in the
middle (while it holds a job) and a new one started.

The answering process and the learner share one store: index rows in a real Chroma server (the
embedded one is single-process), blobs and counters in one folder on this host. Checked: every
answer returned, with no error; every question asked is learned exactly once (one done job, one
memory); usage counters exactly what the answers did; the answering process's RSS flat after
warm-up. The short variant is in the default run (8 s of answering, 8 questions, 2 learned before,
8 tokens; about 2.5 min on a loaded 2-core machine, most of it cpu-tiny learning); the ``slow`` one
answers for 120 s (16 questions, 4 learned before, 16 tokens).
"""

from __future__ import annotations

import collections
import json
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fakes import one_thread
from _reliability import report, row
from _servers import chroma_server

from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.errors import ELMError
from elm_memory.jobs import BackgroundLearner

pytestmark = pytest.mark.model

ANSWERERS = 16
POOL = [f"Sam has {a} marbles and finds {a + 1} more. How many marbles does Sam have?" for a in range(2, 26)]

LEARNER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM

    elm = ELM(ELMConfig.load(preset="cpu-tiny", overrides=json.loads(sys.argv[1])))
    elm.learner  # starts the worker thread: it resumes what a dead learner left and drains the queue
    while True:
        time.sleep(1)
    """
)


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from report(request, ["soak", "soak (slow)"])


class SubmitOnly(BackgroundLearner):
    """The answering process's learner: it records jobs in the queue and never learns (the learner
    process does); ``wait`` and ``job`` read the shared queue."""

    def _ensure_worker(self) -> None:
        return


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def start_learner(overrides: dict, folder: Path, n: int) -> subprocess.Popen:
    """A learner process; it loads the model while the answerers start (its log: ``learner-N.log``)."""
    log = (folder / f"learner-{n}.log").open("w")
    return subprocess.Popen([sys.executable, "-c", LEARNER, json.dumps(overrides)], stdout=log, stderr=log)


def soak(
    tmp_path: Path, tiny_loaded, tiny_backend, seconds: float, variant: str, questions: int, tokens: int, warm: int
) -> None:
    """Answer for ``seconds`` from the first ``questions`` of the pool, ``tokens`` new tokens per
    candidate and training rollout; the first ``warm`` questions are learned before (warm-up), so
    answers use memories from the start."""
    tally = row(f"soak{variant}")
    pool = POOL[:questions]
    with chroma_server(tmp_path / "chroma") as url:
        overrides = {
            "model": {"dtype": "float32"},
            "store": {"path": str(tmp_path / "store"), "url": url},
            "generation": {"max_new_tokens": tokens},
            "training": {"steps": 1, "num_generations": 2, "max_completion_length": tokens},
            "retrieval": {"skip_no_consensus": False},  # SmolLM2 never answers: its memories have no consensus
            "learner": {"mode": "background", "poll_interval": 0.2},
        }
        cfg = ELMConfig.load(preset="cpu-tiny", overrides=overrides)
        queue_path = tmp_path / "store" / "learner.sqlite3"
        submit_only = SubmitOnly(
            lambda job: None, queue_path, start=False, scope=tiny_loaded.info.fingerprint, poll_interval=0.2
        )
        learners = [start_learner(overrides, tmp_path, 0)]
        results: list = []
        errors: list[BaseException] = []
        rss: list[tuple[float, float]] = []
        lock = threading.Lock()
        stop = threading.Event()
        with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend, learner=submit_only) as elm:
            elm.services()
            for q in pool[:warm]:  # warm-up: learned by the first learner before the clock starts
                submit_only.submit(q, "default")
            assert submit_only.wait(timeout=600), (tmp_path / "learner-0.log").read_text()[-3000:]
            t0 = time.monotonic()
            deadline = t0 + seconds

            def answerer(i: int) -> None:
                rng = random.Random(i)
                while time.monotonic() < deadline:
                    try:
                        r = elm.answer(rng.choice(pool))
                    except BaseException as exc:  # counted, then fails the test
                        with lock:
                            errors.append(exc)
                        return
                    with lock:
                        results.append(r)

            def sample_rss() -> None:
                while not stop.wait(0.5):
                    rss.append((time.monotonic() - t0, rss_mib()))

            threads = [threading.Thread(target=answerer, args=(i,)) for i in range(ANSWERERS)]
            sampler = threading.Thread(target=sample_rss, daemon=True)
            sampler.start()
            for t in threads:
                t.start()
            # kill the learner in the middle, while it holds a job, and start another
            while time.monotonic() < t0 + seconds / 2:
                time.sleep(0.05)
            while not (running := submit_only.queue.list("running")):
                assert learners[0].poll() is None, (tmp_path / "learner-0.log").read_text()[-3000:]
                assert time.monotonic() < deadline + 120, "the learner never held a job"
                time.sleep(0.02)
            learners[0].send_signal(signal.SIGKILL)
            learners[0].wait(10)
            killed_holding = running[0].job_id
            rec = submit_only.queue.get(killed_holding)
            assert rec is not None and rec.state == "running"  # killed while it held the job
            learners.append(start_learner(overrides, tmp_path, 1))
            for t in threads:
                t.join(seconds + 300)
            answered_for = time.monotonic() - t0
            assert submit_only.wait(timeout=600), (submit_only.queue.counts(), (tmp_path / "learner-1.log").read_text())
            stop.set()
            store = elm.retriever.store
            jobs = submit_only.queue.list()
            memories = store.list("default")
            counters = store.utility_of("default")
        learners[1].send_signal(signal.SIGTERM)
        learners[1].wait(30)
        submit_only.close()

    tally.runs += 1
    tally.faults += 1
    tally.inputs += len(results)
    tally.errors += len(errors)
    tally.typed_errors += sum(isinstance(e, ELMError) for e in errors)
    assert errors == [] and all(r.response is not None for r in results), errors[:3]
    asked = {r.question for r in results}
    # learned exactly once: one done job and one memory per question asked
    by_job_question = collections.Counter(j.job.question for j in jobs)
    by_memory_question = collections.Counter(m.question for m in memories)
    tally.duplicated += sum(n - 1 for n in by_job_question.values()) + sum(n - 1 for n in by_memory_question.values())
    tally.lost += len(asked - set(by_memory_question)) + sum(1 for j in jobs if j.state != "done")
    assert all(j.state == "done" for j in jobs), [(j.job.question, j.state, j.error) for j in jobs]
    assert set(by_job_question) == asked and set(by_job_question.values()) == {1}
    assert set(by_memory_question) == asked and set(by_memory_question.values()) == {1}
    assert {j.memory_id for j in jobs} == {m.id for m in memories}
    killed = next(j for j in jobs if j.job_id == killed_holding)
    assert killed.job.attempts == 2  # the attempt the kill interrupted, then the resumed one
    # counters: each answer that used a memory counted once on it, no more
    used = collections.Counter(r.memory_id for r in results if r.memory_id)
    retrieved = {mid: u.retrieved for mid, u in counters.items() if u.retrieved}
    hits = {mid: u.usage for mid, u in counters.items() if u.usage}
    assert hits == dict(used)  # top-1, no gate: each answer that used a memory is its one retrieval
    tally.note("answers_with_memory", sum(used.values()))
    assert sum(used.values()) > 0  # the warm-up's memories were used: the counts above are not vacuous
    assert retrieved == dict(used)
    # RSS flat after warm-up: from the end of the first third to the end, growth under 5% (or 32 MiB)
    warm = [v for t, v in rss if t >= answered_for / 3]
    growth = max(warm) - warm[0]
    tally.note("rss_growth_mib", round(growth))
    tally.note("rss_after_warmup_mib", round(warm[0]))
    tally.note("answered_seconds", round(answered_for))
    assert growth < max(0.05 * warm[0], 32), f"RSS grew {growth:.0f} MiB after warm-up ({warm[0]:.0f} MiB)"
    (tmp_path / "soak.json").write_text(json.dumps({"rss_mib": rss, "answers": len(results)}))


@pytest.mark.slow
@pytest.mark.extended
def test_soak_short(tmp_path, tiny_loaded, tiny_backend):
    with one_thread():
        soak(tmp_path, tiny_loaded, tiny_backend, 8, "", questions=8, tokens=8, warm=2)


@pytest.mark.slow
def test_soak_two_minutes(tmp_path, tiny_loaded, tiny_backend):
    with one_thread():
        soak(tmp_path, tiny_loaded, tiny_backend, 120, " (slow)", questions=16, tokens=16, warm=4)
