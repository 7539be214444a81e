"""Process facts read from the operating system: is a pid (or a process group) still alive?

Shared by the job queue (is the worker that holds a job still there?) and the vLLM server
launcher (has every process of the server's group exited?). Linux answers from ``/proc``,
which also tells a zombie from a live process and a reused pid from the original one;
elsewhere the answers fall back to signal 0.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(state, start time in clock ticks, process group) of ``pid``, or None where there is no /proc
    entry (no such process, or not Linux)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": comm may hold spaces and parens
    if len(fields) <= 19:
        return None
    try:
        group = int(fields[2])
    except ValueError:
        return None
    return fields[0], fields[19], group


def start_ticks(pid: int) -> str:
    """The start time of ``pid`` in clock ticks ("" where unknown): with the pid, it names one process
    even after the pid is reused."""
    stat = proc_stat(pid)
    return stat[1] if stat else ""


def pid_alive(pid: int, start: str = "") -> bool:
    """True while ``pid`` runs and is not a zombie; with ``start`` (from :func:`start_ticks`), also
    False once the pid belongs to a later process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return True
    stat = proc_stat(pid)
    if stat is None:
        return True  # no /proc: signal 0 is all there is
    state, started, _group = stat
    if state in ("Z", "X"):  # exited, not yet reaped
        return False
    return not (start and started != start)


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process of process group ``pgid`` exists (Linux: /proc; else killpg 0)."""
    if not PROC.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is not None and stat[0] not in ("Z", "X") and stat[2] == pgid:
            return True
    return False
