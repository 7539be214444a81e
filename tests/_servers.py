"""Real servers started by tests (Chroma, LangGraph): on a free 127.0.0.1 port, stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    """The venv's own script (tests may run without the venv on PATH), else PATH's."""
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else (shutil.which(name) or name)


@contextmanager
def running_server(
    cmd: Sequence[str], health_url: str, log_path: Path, *, timeout: float = 30, **popen: object
) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group, wait for ``health_url`` to answer 200, kill the group after."""
    log = log_path.open("wb")
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(health_url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started (the server and its workers, by our PID), SIGKILL after 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextmanager
def chroma_server(data: Path) -> Iterator[str]:
    """``chroma run`` on ``data``; yields its URL."""
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [console_script("chroma"), "run", "--path", str(data / "db"), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}
    with running_server(cmd, f"{url}/api/v2/heartbeat", data / "server.log", env=env):
        yield url
