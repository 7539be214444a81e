"""``learner.mode: ray``: the dispatcher, the Ray learner actors, and the supervisor that keeps a
dispatcher running.

Who owns what::

    answering processes (any host) ──submit──▶ ledger: SQLite queue on the dispatcher's host
                                                   │ (learner.queue_path; WAL: one host only)
                                                   ▼
    supervisor (``elm learner serve`` or the answering process) ─▶ dispatcher process (Ray driver)
                                                   │ batches of learner.batch_size jobs
                                                   ▼
                     Ray actors "elm-learner-<config hash>-<i>" (num_cpus / num_gpus each),
                     each loads the frozen model once; memories go to the shared store
                     (Chroma server index + blobs on a shared folder)

* The **ledger** is the :class:`~elm_memory.jobs.queue.JobQueue` file. Only processes on its
  host open it: the answering processes there, and the dispatcher. (Answering processes on other
  hosts run their own ledger and dispatcher, and share the actors: actors are named by a hash of
  the config, so the same config finds the same pool.)
* The **dispatcher** (:class:`Dispatcher`, run as ``python -m elm_memory.jobs.ray_dispatch``)
  is the only process that imports Ray. It claims jobs, sends each batch to an idle actor,
  and records the outcome: done with the memory id, or a failed attempt retried after
  ``backoff * 2**(attempt-1)`` seconds (at most ``backoff_max``) on another actor when there is
  one; after ``learner.max_attempts`` the job is ``failed`` with its last error. An actor whose
  process dies mid-job fails that attempt; Ray restarts it (``max_restarts``).
* The **supervisor** (:class:`DispatcherSupervisor`) runs the dispatcher as a child process and
  starts it again when it exits (the cluster was unreachable or went away: Ray may end its
  driver), after releasing the jobs the dead child held without counting an attempt. So
  answering never depends on Ray: a submit is a SQLite insert, and jobs wait in the ledger until
  a cluster is there.
* **Exactly one memory per job.** The memory id is the job id (see :mod:`elm_memory.jobs`), and an
  actor first looks the id up in the store: a job whose memory was stored by an attempt that
  died before reporting back is done without training again. The one window left: a dispatcher
  dies while an actor trains (the actor goes on), and the re-dispatched job starts on another
  actor before the first one stored it; then both train and the second write replaces the first
  (still one memory, the same id).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elm_memory.errors import MemoryNotFoundError
from elm_memory.jobs.owners import HOST, LIVE_OWNERS, new_owner
from elm_memory.jobs.queue import JobQueue
from elm_memory.jobs.records import JobRecord, LearnerError, LearnJob, error_text

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig

log = logging.getLogger("elm_memory.jobs.ray")

ACTOR_PREFIX = "elm-learner"


def pool_key(config: ELMConfig) -> str:
    """What the actors' work depends on (everything but the learner section and the namespace):
    the same key means the same model, method and store, so actors can be shared."""
    data = config.model_dump(mode="json")
    data.pop("learner", None)
    data.pop("namespace", None)
    data.pop("namespace_template", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def actor_name(config: ELMConfig, index: int) -> str:
    return f"{ACTOR_PREFIX}-{pool_key(config)}-{index}"


def gcs_reachable(address: str, timeout: float = 2.0) -> bool:
    """Does ``HOST:PORT`` (or ``ray://HOST:PORT``) accept a TCP connection? True for ``auto`` (Ray
    itself fails fast there). ``ray.init`` on an address nobody listens at retries for minutes."""
    import socket

    if address == "auto" or ":" not in address:
        return True
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def retry_delay(attempt: int, backoff: float, backoff_max: float) -> float:
    """Seconds before retrying after failed attempt number ``attempt`` (1 for the first)."""
    if backoff <= 0:
        return 0.0
    return float(min(backoff_max, backoff * 2 ** max(0, attempt - 1)))


class LearnerWorker:
    """The body of one Ray learner actor: loads the frozen model once, learns batches of jobs.

    Wrapped with ``ray.remote`` by the dispatcher (placement: ``learner.ray.num_cpus`` /
    ``num_gpus``). Rollouts use the config's backend: the actor's own model (``hf``), or a shared
    vLLM server (``backend.name: vllm-server``, prompt embeddings; the model is frozen, so no
    weights move)."""

    def __init__(self, config: dict[str, Any], worker_factory: Callable[[ELMConfig], Any]):
        from elm_memory.config import ELMConfig

        config = {**config, "learner": {**config.get("learner", {}), "mode": "off"}}
        # the facade, handed down by whoever started the dispatcher (jobs never imports it)
        self.elm = worker_factory(ELMConfig.from_dict(config))
        self.elm.backend  # noqa: B018  (load the model and backend now, once)
        if self.elm.retriever is None:
            raise LearnerError("a ray learner needs a memory store (store.kind is 'none')")

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": HOST, "fingerprint": self.elm.loaded.info.fingerprint}

    def _stored(self, job: LearnJob) -> bool:
        retriever = self.elm.retriever
        assert retriever is not None
        try:
            retriever.store.record(job.job_id, job.namespace)
        except MemoryNotFoundError:
            return False
        return True

    def learn(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One result per job, in order: ``{"memory_id": ..., "trained": bool}`` or ``{"error": ...}``.
        The batch trains together; a job the batch did not complete runs again alone."""
        parsed = [LearnJob.from_dict(j) for j in jobs]
        out: list[dict[str, Any]] = [{} for _ in parsed]
        todo = []
        for i, job in enumerate(parsed):
            if self._stored(job):  # an earlier attempt stored it and died before reporting back
                out[i] = {"memory_id": job.job_id, "trained": False}
            else:
                todo.append(i)
        results: list[Any] = self.elm.learn_from_jobs([parsed[i] for i in todo]) if len(todo) > 1 else []
        for n, i in enumerate(todo):
            result = results[n] if results else None
            if not isinstance(result, str):
                try:
                    result = self.elm.learn_from_job(parsed[i])
                except Exception as exc:
                    out[i] = {"error": error_text(exc)}
                    continue
            out[i] = {"memory_id": result, "trained": True}
        return out


class Dispatcher:
    """Claims jobs from the ledger and runs them on the Ray actor pool (one Ray driver).

    ``run`` returns when ``stop`` is set (jobs in flight are released, not counted as attempts)
    and raises when the cluster goes away (the supervisor starts a fresh dispatcher)."""

    def __init__(
        self, config: ELMConfig, queue_path: str | os.PathLike[str], worker_factory: Callable[[ELMConfig], Any]
    ):
        self.config = config
        self.worker_factory = worker_factory
        self.rc = config.learner.ray
        self.batch_size = config.learner.batch_size
        self.poll_interval = min(config.learner.poll_interval, 1.0)
        self.queue = JobQueue(queue_path, max_attempts=config.learner.max_attempts)
        self.owner = new_owner()
        self.stop = threading.Event()
        self._avoid: dict[str, set[int]] = {}  # job id -> actors whose process died running it

    # -- Ray -----------------------------------------------------------------------------
    def connect(self) -> None:
        """Join the cluster; retry every ``reconnect_interval`` s until it answers (or ``stop``)."""
        import ray

        address = self.rc.address or os.environ.get("RAY_ADDRESS") or "auto"
        while not self.stop.is_set():
            if not gcs_reachable(address):
                log.warning("Ray cluster %s unreachable; retrying in %.0fs", address, self.rc.reconnect_interval)
                self.stop.wait(self.rc.reconnect_interval)
                continue
            try:
                ray.init(
                    address=address,
                    namespace=self.rc.namespace,
                    log_to_driver=False,
                    configure_logging=False,
                    include_dashboard=False,
                )
                log.info("dispatcher %s joined Ray cluster at %s", self.owner, address)
                return
            except Exception as exc:  # unreachable: jobs wait in the ledger
                log.warning(
                    "Ray cluster %s unreachable (%s); retrying in %.0fs", address, exc, self.rc.reconnect_interval
                )
                with contextlib.suppress(Exception):
                    ray.shutdown()
                self.stop.wait(self.rc.reconnect_interval)

    def actor(self, index: int) -> Any:
        """Learner actor ``index`` of the named pool (created when absent; shared by every dispatcher
        with this config, and by a restarted dispatcher)."""
        import ray

        return (
            ray.remote(LearnerWorker)
            .options(
                name=actor_name(self.config, index),
                namespace=self.rc.namespace,
                get_if_exists=True,
                lifetime="detached",  # outlives a restarting dispatcher
                num_cpus=self.rc.num_cpus,
                num_gpus=self.rc.num_gpus,
                max_restarts=self.rc.max_restarts,
                max_task_retries=0,  # the ledger retries, with backoff, counting attempts
                max_concurrency=1,
            )
            .remote(self.config.model_dump(mode="json"), self.worker_factory)
        )

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        LIVE_OWNERS.add(self.owner)
        self.queue.recover()
        self.connect()
        if self.stop.is_set():
            return
        pool = [self.actor(i) for i in range(self.rc.num_workers)]
        in_flight: dict[Any, tuple[int, list[JobRecord]]] = {}
        # An actor gets jobs only once it answered a probe (its model is loaded): calls to an actor
        # that is (re)starting fail at once and must not use up the attempts of the jobs.
        ready: set[int] = set()
        probes: dict[Any, int] = {pool[i].info.remote(): i for i in range(len(pool))}
        cooling: dict[int, float] = {}  # actor -> when to probe it again
        last_beat = time.monotonic()
        last_recover = time.monotonic()
        try:
            while not self.stop.is_set():
                for i, when in list(cooling.items()):
                    if time.monotonic() >= when:
                        del cooling[i]
                        pool[i] = self.actor(i)  # the same actor, or a new one if Ray gave it up
                        probes[pool[i].info.remote()] = i
                busy = {a for a, _ in in_flight.values()}
                idle = [i for i in sorted(ready) if i not in busy]
                while idle:
                    recs = self.queue.claim_many(self.owner, self.batch_size)
                    if not recs:
                        break
                    avoid = set().union(*(self._avoid.get(r.job_id, set()) for r in recs))
                    actor = next((i for i in idle if i not in avoid), idle[0])
                    idle.remove(actor)
                    ref = pool[actor].learn.remote([r.job.to_dict() for r in recs])
                    in_flight[ref] = (actor, recs)
                    log.info("sent %d jobs to actor %d: %s", len(recs), actor, ", ".join(r.job_id[:12] for r in recs))
                waiting = [*in_flight, *probes]
                if not waiting:
                    self.stop.wait(self.poll_interval)
                    continue
                done, _ = ray.wait(waiting, num_returns=1, timeout=self.poll_interval)
                for ref in done:
                    if ref in probes:
                        i = probes.pop(ref)
                        try:
                            info = ray.get(ref)
                        except RayActorError:  # still (re)starting
                            cooling[i] = time.monotonic() + 1.0
                        else:
                            ready.add(i)
                            log.info("learner actor %d ready: %s", i, info)
                        continue
                    actor, recs = in_flight.pop(ref)
                    try:
                        results = ray.get(ref)
                    except RayActorError as exc:  # the actor's process died running them (Ray restarts it)
                        ready.discard(actor)
                        cooling[actor] = time.monotonic() + 1.0
                        for r in recs:
                            self._avoid.setdefault(r.job_id, set()).add(actor)
                        self._failed(recs, f"learner actor {actor} died: {type(exc).__name__}")
                    except RayTaskError as exc:  # the batch call itself raised
                        self._failed(recs, f"{type(exc.cause).__name__}: {exc.cause}"[:2000])
                    else:
                        self._record(recs, results)
                now = time.monotonic()
                if in_flight and now - last_beat > self.queue.lease / 4:
                    for _, recs in in_flight.values():
                        for r in recs:
                            self.queue.heartbeat(r.job_id, self.owner)
                    last_beat = now
                if now - last_recover > 30:
                    self.queue.recover()  # jobs of a dispatcher on this host that died
                    last_recover = now
        finally:
            for _, recs in in_flight.values():  # stopped or lost the cluster: not an attempt
                for r in recs:
                    with contextlib.suppress(LearnerError):
                        self.queue.release(r.job_id, self.owner)
            LIVE_OWNERS.discard(self.owner)

    def _record(self, recs: list[JobRecord], results: list[dict[str, Any]]) -> None:
        for rec, result in zip(recs, results, strict=True):
            if "error" in result:
                self._failed([rec], result["error"])
            elif self.queue.complete(rec.job_id, self.owner, result["memory_id"]):
                self._avoid.pop(rec.job_id, None)
                how = "learned" if result.get("trained") else "already stored"
                log.info("job %s done (%s) -> memory %s", rec.job_id[:12], how, result["memory_id"])

    def _failed(self, recs: list[JobRecord], error: str) -> None:
        for rec in recs:
            delay = retry_delay(rec.job.attempts, self.rc.backoff, self.rc.backoff_max)
            after = self.queue.fail(rec.job_id, self.owner, error, retry_in=delay)
            if after is not None and after.state == "failed":
                log.error("job %s failed for good after %d attempts: %s", rec.job_id[:12], rec.job.attempts, error)
                self._avoid.pop(rec.job_id, None)
            else:
                log.warning(
                    "job %s attempt %d failed (%s); retry in %.0fs", rec.job_id[:12], rec.job.attempts, error, delay
                )


class DispatcherSupervisor:
    """Runs a dispatcher process for one ledger and starts it again whenever it exits.

    Between restarts it waits ``reconnect_interval`` s (doubled after each quick exit, at most
    60 s) and releases the jobs the dead child still held, without counting an attempt: a
    dispatcher that lost its cluster did not fail the job."""

    def __init__(
        self,
        config: ELMConfig,
        queue_path: str | os.PathLike[str],
        *,
        worker_factory: Callable[[ELMConfig], Any],
        log_path: Path | None = None,
    ):
        self.config = config
        self.worker_factory = worker_factory
        self.queue_path = Path(queue_path)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        fd, name = tempfile.mkstemp(prefix="elm-ray-config-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(config.model_dump(mode="json"), fh)
        self._config_file = Path(name)

    def command(self) -> list[str]:
        factory = f"{self.worker_factory.__module__}:{self.worker_factory.__qualname__}"
        return [
            sys.executable,
            "-m",
            "elm_memory.jobs.ray_dispatch",
            str(self._config_file),
            str(self.queue_path),
            "--worker-factory",
            factory,
        ]

    def start(self) -> None:
        """Watch the dispatcher from a daemon thread (the answering process's ``dispatcher: auto``)."""
        self._thread = threading.Thread(target=self.run, name="elm-memory-ray-supervisor", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self) -> None:
        """Keep a dispatcher running until :meth:`stop`."""
        wait = self.config.learner.ray.reconnect_interval
        while not self._stop.is_set():
            started = time.monotonic()
            out = self.log_path.open("ab") if self.log_path is not None else None
            try:
                self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT if out else None)
            finally:
                if out is not None:
                    out.close()
            log.info("ray dispatcher started (pid %d) for %s", self.proc.pid, self.queue_path)
            rc = self.proc.wait()
            self.release_jobs_of(self.proc.pid)
            if self._stop.is_set():
                break
            self.restarts += 1
            wait = self.config.learner.ray.reconnect_interval if time.monotonic() - started > 60 else min(60, wait * 2)
            log.warning("ray dispatcher exited (rc %s); starting another in %.0fs", rc, wait)
            self._stop.wait(wait)

    def release_jobs_of(self, pid: int) -> int:
        """Jobs left ``running`` by the dispatcher ``pid`` of this host go back to ``pending``, uncounted."""
        n = 0
        with JobQueue(self.queue_path, max_attempts=self.config.learner.max_attempts) as queue:
            for rec in queue.list("running"):
                if rec.owner and rec.owner.startswith(f"{HOST}|{pid}|") and queue.release(rec.job_id, rec.owner):
                    n += 1
        if n:
            log.info("released %d jobs of the exited dispatcher %d", n, pid)
        return n

    def request_stop(self) -> None:
        """Ask the dispatcher to stop (SIGTERM: it releases its jobs); returns at once (signal-safe)."""
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the dispatcher and the watching; kill the dispatcher if it has not exited in ``timeout`` s."""
        self.request_stop()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        elif proc is not None:
            self.release_jobs_of(proc.pid)
        with contextlib.suppress(OSError):
            self._config_file.unlink()


def main(argv: list[str] | None = None) -> int:
    """``python -m elm_memory.jobs.ray_dispatch CONFIG_JSON QUEUE --worker-factory MODULE:NAME``: one
    dispatcher (run by the supervisor; the factory is what each actor builds from the config)."""
    from elm_memory.config import ELMConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("config_json")
    parser.add_argument("queue")
    parser.add_argument("--worker-factory", required=True, help="MODULE:NAME of the actors' factory")
    args = parser.parse_args(argv)
    module, _, name = args.worker_factory.partition(":")
    worker_factory: Any = importlib.import_module(module)
    for part in name.split("."):
        worker_factory = getattr(worker_factory, part)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s elm-ray-dispatch[%(process)d] %(message)s")
    config = ELMConfig.from_dict(json.loads(Path(args.config_json).read_text()))
    dispatcher = Dispatcher(config, args.queue, worker_factory)
    signal.signal(signal.SIGTERM, lambda *_: dispatcher.stop.set())
    rc = 0
    try:
        dispatcher.run()
    except KeyboardInterrupt:
        pass
    except Exception:
        log.exception("dispatcher stopped")
        rc = 1
    dispatcher.queue.close()
    logging.shutdown()
    return rc


if __name__ == "__main__":
    # os._exit: the ledger is committed and closed; Ray's own teardown of a driver whose cluster went
    # away can hang, and the supervisor must see this process end
    os._exit(main())
