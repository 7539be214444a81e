"""Benchmark: memories per hour with ``learner.mode: ray`` and 1 or 2 learner actors, and the
overhead of one Ray job against the in-process learner for the same memory (issue #14).

Starts its own Ray head on 127.0.0.1 (``--num-cpus`` CPUs) and Chroma server, stops both by
PID. For each pool size: the actors are started and load the model, then ``--jobs`` jobs are
submitted at once, timed from the first submit to the last done. The overhead: the same
question learned in this process (``ELM.learn``, model already loaded) and as one job on a warm
1-actor pool (submit -> done in the ledger), both on 1 CPU thread, alternating over
``--overhead-repeats`` questions (medians).

    .venv/bin/python -m benchmarks.learner_scaling              # cpu-tiny, S=1, 4 jobs
    .venv/bin/python -m benchmarks.learner_scaling --jobs 6 --steps 2

Writes ``benchmarks/results/learner_scaling.json``. On a 2-core machine two actors cannot
double the rate: each actor gets one core, and the dispatcher, Ray and Chroma share them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "learner_scaling.json"
QUESTIONS = [
    "What is 12 + 30?",
    "What is 7 * 6?",
    "What is 100 - 58?",
    "What is 84 / 2?",
    "What is 40 + 2?",
    "What is 6 * 7?",
    "What is 21 * 2?",
    "What is 50 - 8?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _session_pids(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                out.append(int(entry))
    return out


def _stop_session(sid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"nothing listening on {port}")


def _learner_config(args: argparse.Namespace, store_url: str, blobs: Path, address: str, workers: int) -> Any:
    from elm_memory.config import ELMConfig

    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "store": {"url": store_url, "path": str(blobs)},
            "training": {"steps": args.steps},
            "learner": {
                "mode": "ray",
                "batch_size": args.batch_size,
                "poll_interval": 0.2,
                "ray": {
                    "address": address,
                    "num_workers": workers,
                    "num_cpus": 1,
                    "backoff": 1,
                    "reconnect_interval": 1,
                    "dispatcher": "auto",
                },
            },
        },
    )


def _warm_pool(cfg: Any, ledger: Path) -> float:
    """Create (or find) the pool's actors and wait until each has loaded the model."""
    import ray

    from elm_memory.elm import ELM
    from elm_memory.jobs.ray_dispatch import Dispatcher

    if not ray.is_initialized():
        ray.init(address=cfg.learner.ray.address, namespace=cfg.learner.ray.namespace, log_to_driver=False)
    t0 = time.monotonic()
    d = Dispatcher(cfg, ledger, ELM)
    ray.get([d.actor(i).info.remote() for i in range(cfg.learner.ray.num_workers)])
    d.queue.close()
    return time.monotonic() - t0


def _run_pool(args: argparse.Namespace, cfg: Any, ledger: Path, namespace: str, workers: int) -> dict[str, Any]:
    from elm_memory.elm import ELM
    from elm_memory.jobs import build_learner

    warm_s = _warm_pool(cfg, ledger)
    learner = build_learner(
        "ray", None, ledger, scope="bench", config=cfg, batch_size=args.batch_size, worker_factory=ELM
    )
    try:
        t0 = time.monotonic()
        tickets = [learner.submit(q, namespace=namespace) for q in QUESTIONS[: args.jobs]]
        if not learner.wait(timeout=3600):
            raise RuntimeError(f"jobs did not finish: {learner.status()}")
        seconds = time.monotonic() - t0
        states = [learner.job(t.job_id) for t in tickets]
        done = sum(1 for r in states if r is not None and r.state == "done")
    finally:
        learner.close()
    return {
        "workers": workers,
        "jobs": args.jobs,
        "done": done,
        "seconds": round(seconds, 1),
        "memories_per_hour": round(done / seconds * 3600, 1),
        "actor_start_s": round(warm_s, 1),
    }


def _overhead(args: argparse.Namespace, cfg: Any, ledger: Path, store_url: str, blobs: Path) -> dict[str, Any]:
    """For each of ``--overhead-repeats`` questions: learned in this process, then as one Ray job on a
    warm 1-actor pool (alternating, so both see similar machine load); medians and each pair."""
    from elm_memory.elm import ELM
    from elm_memory.jobs import build_learner

    elm = _in_process_elm(args, store_url, blobs)
    _warm_pool(cfg, ledger)
    learner = build_learner("ray", None, ledger, scope="bench", config=cfg, batch_size=1, worker_factory=ELM)
    pairs: list[dict[str, Any]] = []
    try:
        learner.submit("Warm-up overhead: what is 2 + 2?", namespace="overhead")  # the dispatcher starts
        learner.wait(timeout=900)
        for question in QUESTIONS[-args.overhead_repeats :]:
            t0 = time.monotonic()
            elm.learn(question, namespace="inproc", progress=False)
            local = time.monotonic() - t0
            t0 = time.monotonic()
            ticket = learner.submit(question, namespace="overhead")
            if not learner.wait(ticket.job_id, timeout=900):
                raise RuntimeError("overhead job did not finish")
            remote = time.monotonic() - t0
            pairs.append({"question": question, "in_process_s": round(local, 2), "ray_job_s": round(remote, 2)})
            print(json.dumps(pairs[-1]), flush=True)
    finally:
        learner.close()
    local_med = statistics.median(p["in_process_s"] for p in pairs)
    remote_med = statistics.median(p["ray_job_s"] for p in pairs)
    return {
        "pairs": pairs,
        "in_process_learn_s_median": round(local_med, 2),
        "ray_job_submit_to_done_s_median": round(remote_med, 2),
        "ray_overhead_s_median": round(statistics.median(p["ray_job_s"] - p["in_process_s"] for p in pairs), 2),
    }


def _in_process_elm(args: argparse.Namespace, store_url: str, blobs: Path) -> Any:
    """An in-process learner with the model loaded, on 1 thread (what a num_cpus=1 actor gets)."""
    import torch

    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM

    torch.set_num_threads(1)  # what a Ray actor with num_cpus=1 gets (OMP_NUM_THREADS=1)
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "store": {"url": store_url, "path": str(blobs)},
            "training": {"steps": args.steps},
            "learner": {"mode": "off"},
        },
    )
    elm = ELM(cfg)
    elm.backend  # noqa: B018
    elm.retriever  # noqa: B018
    return elm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs the Ray head offers")
    parser.add_argument("--overhead-repeats", type=int, default=3, help="questions timed both ways")
    parser.add_argument("--skip-pools", action="store_true", help="only the overhead")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = Path(tempfile.mkdtemp(prefix="elm-learner-scaling-"))
    chroma_port, ray_port = _free_port(), _free_port()
    chroma = subprocess.Popen(
        [_bin("chroma"), "run", "--path", str(tmp / "db"), "--host", "127.0.0.1", "--port", str(chroma_port)],
        stdout=(tmp / "chroma.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
    )
    ray_temp = f"/tmp/elmray-bench-{ray_port}"
    head = subprocess.Popen(
        [
            _bin("ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={ray_port}",
            f"--num-cpus={args.num_cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={ray_temp}",
        ],
        stdout=(tmp / "ray.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    store_url, address = f"http://127.0.0.1:{chroma_port}", f"127.0.0.1:{ray_port}"
    out: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "model": "cpu-tiny (SmolLM2-135M)",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "ray_head_cpus": args.num_cpus,
    }
    try:
        _wait_port(chroma_port)
        _wait_port(ray_port)
        blobs = tmp / "blobs"
        cfg1 = _learner_config(args, store_url, blobs, address, 1)
        out["overhead"] = _overhead(args, cfg1, tmp / "overhead.sqlite3", store_url, blobs)
        out["pools"] = []
        for workers in () if args.skip_pools else (1, 2):
            cfg = _learner_config(args, store_url, blobs, address, workers)
            res = _run_pool(args, cfg, tmp / f"ledger-{workers}.sqlite3", f"w{workers}", workers)
            print(json.dumps(res), flush=True)
            out["pools"].append(res)
        if out["pools"]:
            one, two = out["pools"]
            out["speedup_2_vs_1"] = round(two["memories_per_hour"] / one["memories_per_hour"], 2)
        out["load_avg_at_end"] = os.getloadavg()
    finally:
        _stop_session(head.pid)
        _stop_session(chroma.pid)
        subprocess.run(["rm", "-rf", ray_temp, str(tmp)], check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
