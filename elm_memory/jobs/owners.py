"""Worker identity: who holds a running job, and is that worker still alive?

A worker that claims a job writes its owner token into the job's row:
``host|pid|process start ticks|random token``. Whether the owner is gone decides whether a
``running`` job may be handed to another worker (the crash-resume path). For a pid of this
host the operating system answers (:mod:`elm_memory.processes`); for workers inside this
very process, which share its pid, only the process itself knows, so it keeps the set of
its live owner tokens (:data:`LIVE_OWNERS`).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid

from elm_memory.processes import pid_alive, start_ticks

HOST = socket.gethostname()


class LiveOwners:
    """The owner tokens of the workers running in this process (thread-safe)."""

    def __init__(self) -> None:
        self._tokens: set[str] = set()
        self._lock = threading.Lock()

    def add(self, owner: str) -> None:
        with self._lock:
            self._tokens.add(owner)

    def discard(self, owner: str) -> None:
        with self._lock:
            self._tokens.discard(owner)

    def __contains__(self, owner: object) -> bool:
        with self._lock:
            return owner in self._tokens


#: Process-wide on purpose: it describes this process, and every queue opened in it (by any
#: learner) must see the same answer about a worker of this pid.
LIVE_OWNERS = LiveOwners()


def new_owner() -> str:
    """A fresh owner token for a worker of this process (not yet live: see :data:`LIVE_OWNERS`)."""
    pid = os.getpid()
    return f"{HOST}|{pid}|{start_ticks(pid)}|{uuid.uuid4().hex[:12]}"


def owner_is_alive(owner: str | None) -> bool | None:
    """Is the worker that holds a running job still there?

    False when provably gone: its process died (or its pid now belongs to another
    process), or it was a worker of *this* process that has exited. None for an owner named
    with another host (a queue file copied from elsewhere: every process that opens a queue
    runs on its host), whose pid means nothing here: the queue then judges by heartbeat age."""
    if not owner:
        return False
    try:
        host, pid_text, start, _token = owner.rsplit("|", 3)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != HOST:
        return None
    if pid == os.getpid():
        return owner in LIVE_OWNERS
    return pid_alive(pid, start)
