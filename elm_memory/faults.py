"""Named fault points on the write paths, for crash tests: off (one global read) unless armed.

Every step of a write that a crash could interrupt calls :func:`point` with the step's name.
Normally that is all it does: read one module global and return. A crash test arms one point,
in a child process through the environment or in-process with :func:`arm`, and the process
then stops at that step on its N-th pass:

``ELM_FAULT=NAME@N:MODE``
    ``kill`` (SIGKILL to this process: a ``kill -9``, nothing runs after it), ``exit``
    (``os._exit(137)``) or ``raise`` (:class:`InjectedFault`, which ``finally`` blocks see).
``ELM_FAULT_TRACE=FILE``
    append each point's name to ``FILE`` as it is passed (a calibration run counts the passes).

The points, in the order a write passes them:

- blobs (``store/blobs.py``): ``blob.temp_written`` (bytes in the temp file), ``blob.fsynced``
  (temp file fsynced), ``blob.renamed`` (renamed over its final name, folder not yet fsynced),
  ``blob.delete`` (before a blob is unlinked);
- a put (``store/chroma/store.py``, ``index.py``): ``put.blobs_written``, ``index.upsert`` (before
  each batch of rows), ``put.rows_written``, ``put.stale_removed`` (superseded rows and blobs
  gone, before expiry and eviction);
- a delete, an eviction, an expiry (``store/chroma/deletes.py``): ``delete.journalled``,
  ``index.delete`` (before each batch of rows), ``delete.rows_removed``, ``delete.blobs_removed``
  (counters and journal entry not yet forgotten);
- counters (``store/utility.py``): ``utility.usage`` (before a usage update);
- a merge (``store/chroma/merges.py``): ``merge.written`` (merged memory put, members untouched),
  ``merge.absorbed`` (members' counters added to it and their deletes journalled), then a delete's points;
- jobs (``jobs/queue.py``, ``jobs/queue_learner.py``): ``job.added``, ``job.claimed``,
  ``job.learned`` (memory stored, job not yet completed), ``job.completed``, ``job.failed``,
  ``job.released``, ``job.recovered`` (each after its transaction committed);
- ``memories import`` (``store/cli.py``): ``import.read`` (files read and checked, nothing stored).

Points sit at write steps only, never in a per-token or per-row loop of the answer path.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from elm_memory.errors import ConfigError

ENV = "ELM_FAULT"
TRACE_ENV = "ELM_FAULT_TRACE"
MODES = ("kill", "exit", "raise")


class InjectedFault(RuntimeError):
    """Raised at an armed point in ``raise`` mode (a test's stand-in for a crash)."""


@dataclass
class Plan:
    """Stop at the ``nth`` pass (1-based) of point ``name``; ``name=None`` only traces."""

    name: str | None = None
    nth: int = 1
    mode: str = "kill"
    trace: str | None = None
    seen: dict[str, int] = field(default_factory=dict)

    def hit(self, name: str) -> None:
        if self.trace is not None:
            with open(self.trace, "a", encoding="utf-8") as fh:
                fh.write(name + "\n")
        if name != self.name:
            return
        n = self.seen[name] = self.seen.get(name, 0) + 1
        if n != self.nth:
            return
        if self.mode == "raise":
            raise InjectedFault(f"injected fault at {name} (pass {n})")
        if self.mode == "exit":
            os._exit(137)
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str | None, trace: str | None = None) -> Plan | None:
    """``NAME@N:MODE`` (``@N`` defaults to 1, ``:MODE`` to kill) -> a plan; None when neither is set.
    A malformed spec is a :class:`~elm_memory.errors.ConfigError` (a ``ValueError``)."""
    if not spec:
        return Plan(trace=trace) if trace else None
    rest, _, mode = spec.partition(":")
    name, _, nth = rest.partition("@")
    mode = mode or "kill"
    if not name or mode not in MODES or (nth and not nth.isdigit()) or (nth and int(nth) < 1):
        raise ConfigError(f"{ENV}={spec!r}: expected NAME@N:MODE with N >= 1 and MODE one of {', '.join(MODES)}")
    return Plan(name, int(nth or 1), mode, trace)


_plan: Plan | None = parse(os.environ.get(ENV), os.environ.get(TRACE_ENV))


def point(name: str) -> None:
    """A named step of a write; does nothing unless a plan is armed."""
    if _plan is not None:
        _plan.hit(name)


def arm(plan: Plan | None) -> Plan | None:
    """Arm ``plan`` in this process (None disarms); returns the previous one."""
    global _plan
    previous, _plan = _plan, plan
    return previous
