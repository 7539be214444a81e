"""``elm env``: what a bug or performance report needs, in one object.

In the manner of ``transformers env`` and vLLM's ``collect_env``: the platform, the CPU and
the capability flags that decide the dtype, its load now (a timing on busy cores is slowed), the
GPUs, the decision :mod:`elm_memory.hardware` takes for the given config, and the versions of the
libraries elm-memory runs on.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from elm_memory.hardware import NOT_ASKED, Hardware, resolve_one_row_engine, resolve_placement

#: Distributions whose versions change behaviour or speed (missing ones are reported as None).
REPORTED_PACKAGES = (
    "elm-memory",
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "vllm",
    "chromadb",
    "langgraph",
    "langchain-core",
    "safetensors",
    "pydantic",
    "numpy",
)


def package_versions(names: tuple[str, ...] = REPORTED_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def collect_env(config: Any, hardware: Hardware | None = None, llama_missing: str | None = NOT_ASKED) -> dict[str, Any]:
    """The report for an :class:`~elm_memory.config.ELMConfig` (nothing is loaded or downloaded).
    ``llama_missing``: why llama.cpp cannot serve the configured model (None: it can; the caller asks
    ``elm_memory.backends.llama_rows.missing``, a layer above this one)."""
    hw = hardware or Hardware.detect()
    placement = resolve_placement(config.model, hw, warn=False)
    engine, engine_reason = resolve_one_row_engine(
        config.backend.one_row_engine,
        placement,
        backend=config.backend.name,
        decode_loop=config.backend.decode_loop,
        llama_missing=llama_missing,
    )
    return {
        "platform": {
            "system": platform.platform(),
            "python": sys.version.split()[0],
        },
        "cpu": hw.cpu.to_dict(),
        "load": cpu_load(hw.cpu.usable_cores),
        "gpus": [g.to_dict() for g in hw.gpus],
        "resolved": {
            "model": config.model.name_or_path,
            "device": placement.device,
            "dtype": placement.dtype,
            "dtype_requested": config.model.dtype,
            "num_threads": placement.num_threads,
            "attn_implementation": placement.attn_implementation,
            "cpu_allocator": placement.cpu_allocator,
            "weight_prepack": placement.weight_prepack,
            "backend": config.backend.name,
            "one_row_engine": engine,
            "one_row_engine_reason": engine_reason,
            "training_engine": config.training.engine,
            "verifier": config.verifier.name,
            "reasons": list(placement.reasons),
            "warnings": list(placement.warnings),
        },
        "packages": package_versions(),
        "code": code_version(),
    }


#: Above this 1-minute load per usable core, other work holds the cores: a timing taken now is slowed (two decoders on
#: two cores slow each other several times over).
BUSY_LOAD_PER_CORE = 0.5


def cpu_load(usable_cores: int) -> dict[str, Any] | None:
    """The load averages (1, 5, 15 minutes) and whether other work holds the cores now (``busy``); None where the
    system has no load average."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):  # Windows
        return None
    busy = one >= BUSY_LOAD_PER_CORE * max(1, usable_cores)
    return {"load_1min": round(one, 2), "load_5min": round(five, 2), "load_15min": round(fifteen, 2), "busy": busy}


def format_load(load: dict[str, Any] | None, usable_cores: int) -> str:
    """``0.12 0.30 0.41 (1, 5, 15 min) on 2 usable cores: quiet``, or ``busy`` with what it means for timings."""
    if load is None:
        return "not reported by this system"
    one, five, fifteen = (load[f"load_{m}min"] for m in (1, 5, 15))
    text = f"{one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min) on {usable_cores} usable cores"
    return text + (": busy (other work holds the cores: timings now are slowed)" if load["busy"] else ": quiet")


def code_version() -> dict[str, Any]:
    """Which elm-memory code runs: the package's version and, when it runs from its own git checkout, the commit
    and whether tracked files of the package (``elm_memory/``) differ from it (``dirty``). Evidence is one code
    version: a run records this, and a resume under other code adds its own, so mixed code shows. Installed
    (also inside some other repository) ``commit`` is None."""
    source = Path(__file__).resolve().parent
    commit: str | None = None
    dirty: bool | None = None
    try:
        head = _git(source, "rev-parse", "--show-toplevel", "HEAD")
        lines = head.stdout.split()
        # the package's own checkout only: a wheel installed in a venv inside a user's repository is not it
        if head.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == source.parent:
            commit = lines[1]
            status = _git(source, "status", "--porcelain", "--untracked-files=no", "--", ".")
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):  # no git, or a slow file system: the version alone
        pass
    return {"version": package_versions(("elm-memory",))["elm-memory"], "commit": commit, "dirty": dirty}


def _git(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30, check=False)


def format_code(code: dict[str, Any]) -> str:
    """``0.1.0, commit 4b26fa7 (uncommitted changes)``: one line for reports."""
    text = str(code.get("version") or "unknown version")
    if code.get("commit"):
        text += f", commit {str(code['commit'])[:7]}" + (" (uncommitted changes)" if code.get("dirty") else "")
    return text


def mixed_code_warning(codes: list[dict[str, Any]]) -> str | None:
    """A warning when ``codes`` (the code versions a run, or several, recorded) are more than one version or
    include uncommitted changes; None when they are one clean version."""
    shown = sorted({format_code(c) for c in codes})
    if len(shown) > 1 or any(c.get("dirty") for c in codes):
        return "records come from more than one code version or from uncommitted code: " + "; ".join(shown)
    return None


def format_env(report: dict[str, Any]) -> str:
    """Plain text, one fact a line, for pasting into an issue."""
    cpu, res = report["cpu"], report["resolved"]
    flags = " ".join(f for f, on in cpu["flags"].items() if on) or "-"
    lines = [
        f"platform        {report['platform']['system']}, Python {report['platform']['python']}",
        f"cpu             {cpu['name']} ({cpu['architecture']}), {cpu['physical_cores']} physical / "
        f"{cpu['logical_cores']} logical cores, {cpu['usable_cores']} usable",
        f"cpu flags       {flags}",
        f"torch cpu path  {cpu['torch_capability']}; native bf16: {'yes' if cpu['fast_bf16'] else 'no'}",
    ]
    if "load" in report:
        lines.append(f"load            {format_load(report['load'], cpu['usable_cores'])}")
    if report["gpus"]:
        for g in report["gpus"]:
            lines.append(
                f"gpu {g['index']:<11} {g['name']}, {g['total_memory_gib']} GiB, sm {g['compute_capability']}, "
                f"bf16: {'yes' if g['bf16'] else 'no'}"
            )
    else:
        lines.append("gpu             none")
    lines += [
        f"model           {res['model']}",
        f"resolved        device {res['device']}, dtype {res['dtype']} (requested {res['dtype_requested']}), "
        f"{res['num_threads']} threads, {res['attn_implementation']} attention, {res['cpu_allocator']} allocator, "
        f"{'prepacked' if res.get('weight_prepack') else 'plain'} weights",
        f"why             {'; '.join(res['reasons'])}",
        f"backend         {res['backend']} (training engine {res['training_engine']}, verifier {res['verifier']})",
    ]
    if "one_row_engine" in res:
        lines.append(f"one-row engine  {res['one_row_engine']} ({res['one_row_engine_reason']})")
    lines += [f"warning         {w}" for w in res["warnings"]]
    lines.append("packages        " + ", ".join(f"{k} {v or 'not installed'}" for k, v in report["packages"].items()))
    if "code" in report:
        lines.append(f"code            elm-memory {format_code(report['code'])}")
    return "\n".join(lines)
