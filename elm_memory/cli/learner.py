"""``elm learner ...``: the job ledger and the Ray learning service, without loading a model.

``elm learner serve`` runs a dispatcher for this host's ledger (``learner.queue_path``, default
``<store.path>/learner.sqlite3``) on a Ray cluster (``learner.ray.address``) and restarts it
whenever it exits; ``elm learner status`` prints the ledger's counts and jobs.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from elm_memory.cli.errors import handle_errors
from elm_memory.cli.options import ConfigOpt, JsonOpt, PresetOpt, SetOpt, load_config
from elm_memory.errors import ConfigError

learner_app = typer.Typer(help="Learning jobs: the ledger and the Ray learning service.", no_args_is_help=True)

QueueOpt = Annotated[Path | None, typer.Option("--queue", help="Ledger file (default: learner.queue_path).")]


def _queue_path(cfg: Any, queue: Path | None) -> Path:
    from elm_memory.jobs.records import default_queue_path

    if queue is not None:
        return queue.expanduser().resolve()
    lc = cfg.learner
    return Path(lc.queue_path).expanduser() if lc.queue_path else default_queue_path(cfg.store.path)


@learner_app.command("serve")
@handle_errors
def serve(config: ConfigOpt = None, preset: PresetOpt = None, set_: SetOpt = None, queue: QueueOpt = None) -> None:
    """Learn this host's queued jobs on Ray actors until stopped (Ctrl-C / SIGTERM).

    Needs the extra ``.[ray]``. The actors use this config (model, method, store: point
    ``store.url`` at the Chroma server and ``store.path`` at the shared blob folder)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("elm learner serve needs Ray: pip install 'elm-memory[ray]'") from None
    from elm_memory.elm import ELM
    from elm_memory.jobs.ray_dispatch import DispatcherSupervisor

    cfg = load_config(config, preset, None, set_)
    path = _queue_path(cfg, queue)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("elm learner: %(message)s"))
    jobs_log = logging.getLogger("elm_memory.jobs")
    jobs_log.addHandler(handler)
    jobs_log.setLevel(logging.INFO)
    supervisor = DispatcherSupervisor(cfg, path, worker_factory=ELM)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.request_stop())
    typer.echo(f"elm learner: serving {path} on Ray {cfg.learner.ray.address or 'auto'}", err=True)
    try:
        supervisor.run()
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop()


@learner_app.command("status")
@handle_errors
def status(
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    queue: QueueOpt = None,
    json_out: JsonOpt = False,
    jobs: Annotated[bool, typer.Option("--jobs", help="Also list every job.")] = False,
) -> None:
    """Counts of submitted (pending), running, done and failed jobs in the ledger."""
    from elm_memory.jobs.queue import JobQueue

    cfg = load_config(config, preset, None, set_)
    path = _queue_path(cfg, queue)
    if not path.exists():
        raise ConfigError(f"no learner ledger at {path}")
    with JobQueue(path) as q:
        counts = q.counts()
        rows = q.list() if jobs else []
    listed: list[dict[str, Any]] = [
        {
            "job_id": r.job_id,
            "state": r.state,
            "attempts": r.job.attempts,
            "memory_id": r.memory_id,
            "error": r.error,
            "namespace": r.job.namespace,
        }
        for r in rows
    ]
    if json_out:
        typer.echo(json.dumps({"queue": str(path), **counts, "jobs": listed}))
        return
    typer.echo(f"{path}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for j in listed:
        typer.echo(
            f"{j['job_id'][:12]}  {j['state']:<8} attempts {j['attempts']}  {j['memory_id'] or j['error'] or ''}"
        )
