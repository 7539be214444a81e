"""The run directory's durable files: the manifest and the per-question records.

Records are appended one JSON line at a time and fsynced, so a run killed at any point
leaves every finished (method, question) intact; a line cut by the kill is ignored on
reading and that question is simply run again.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from elm_memory.atomic import write_bytes_atomic
from elm_memory.errors import ConfigError


def run_dir(path: str | os.PathLike[str]) -> Path:
    """A run directory as an absolute path, resolved here only: the store paths inside it are saved
    in the run's config, and a relative one would be re-rooted under ``$ELM_HOME``."""
    return Path(path).resolve()


class RecordLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the tail of a killed write
        return out

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:  # after a killed write, start a fresh line
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write JSON atomically (unique temp file in the same directory, fsync, ``os.replace``).

    A crash mid-write leaves the old file or the new one, never half of one; NaN/inf are
    refused because they are not JSON and would break other readers.
    """
    text = json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    return write_bytes_atomic(path, text.encode("utf-8"))


#: Manifest lists a resume extends instead of matching: the machines and the code versions that ran.
APPENDED_FIELDS = ("machines", "code_versions")


def check_manifest(
    out_dir: Path,
    manifest: dict[str, Any],
    fields: tuple[str, ...],
    defaults: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write the run's manifest, or check that an existing one describes the same run.

    Resuming with another dataset order or config would mix two experiments in one table,
    so it is refused; adding methods to a run is allowed (they run on the same order).
    ``manifest["machines"]`` (see :func:`machine_facts`) is not part of a run's identity: a resume
    on another machine adds its own, so every number in the run can be read with its CPU; so does
    ``manifest["code_versions"]`` (:func:`~elm_memory.environment.code_version`), so mixed code shows.
    ``defaults`` maps a field to its default value (e.g. ``"config"`` to the default config's dump):
    a key the old manifest lacks reads as its default, so a run written before a setting existed
    resumes under a newer version as long as the setting keeps its default; a setting that moved is read in its
    new place.
    """
    path = out_dir / "run.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        for f, default in (defaults or {}).items():
            if isinstance(old.get(f), dict):
                old[f] = _with_defaults(_current_keys(old[f]), default)
        for f in fields:
            if old.get(f) != manifest.get(f):
                where = _first_difference(old.get(f), manifest.get(f), f)
                raise ConfigError(
                    f"{out_dir} holds another run (its {f} differs{where}); resume with the same arguments "
                    "(a preset's value that changed since: pass the run's own with --set) or use a new --out"
                )
        old_methods = list(old.get("methods", []))
        appended = {}
        for f in APPENDED_FIELDS:
            values = list(old.get(f, []))
            appended[f] = values + [v for v in manifest.get(f, []) if v not in values]
        manifest = {
            **old,
            "methods": old_methods + [m for m in manifest["methods"] if m not in old_methods],
            **appended,
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest)
    return manifest


def _first_difference(old: Any, new: Any, path: str) -> str:
    """``": at KEY.PATH the run has X, now Y"`` for the first differing leaf of two nested dicts
    (empty where there is no single leaf to name, e.g. two question lists)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{path}.{key}")
        return ""
    if isinstance(old, list) or isinstance(new, list):
        return ""
    return f": at {path} the run has {old!r}, now {new!r}"


def config_defaults() -> dict[str, dict[str, Any]]:
    """``check_manifest``'s ``defaults`` for a manifest whose ``"config"`` is an :class:`ELMConfig` dump."""
    from elm_memory.config import ELMConfig

    return {"config": ELMConfig().model_dump(mode="json")}


def _current_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A config dump written before ``stream``'s tuned settings moved into ``stream.tuning``, as it reads now."""
    from elm_memory.config.stream import moved_into_tuning

    stream = config.get("stream")
    return {**config, "stream": moved_into_tuning(stream)} if isinstance(stream, dict) else config


def _with_defaults(old: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    out = dict(old)
    for key, value in default.items():
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _with_defaults(out[key], value)
    return out


def machine_facts(config: Any) -> dict[str, Any]:
    """What a run's timings and bf16 results depend on: CPU, its bf16 capability, GPUs and the resolved
    device, dtype and threads (from ``elm env``). Nothing is loaded."""
    from elm_memory.backends.llama_rows import missing_for
    from elm_memory.environment import collect_env

    env = collect_env(config, llama_missing=missing_for(config))
    cpu = env["cpu"]
    return {
        "cpu": cpu.get("name"),
        "cores": cpu.get("usable_cores"),
        "cpu_flags": sorted(k for k, v in (cpu.get("flags") or {}).items() if v),
        "torch_cpu_path": cpu.get("torch_capability"),
        "gpus": [g.get("name") for g in env["gpus"]],
        "device": env["resolved"]["device"],
        "dtype": env["resolved"]["dtype"],
        "num_threads": env["resolved"]["num_threads"],
        "torch": env["packages"].get("torch"),
    }


def training_votes(stats: Any) -> dict[str, Any]:
    """A memory's training votes (its ``TrainingStats``): per step, each distinct rollout answer with its
    count (most first; None: no box), and the last step's majority: how much agreement the reward had."""
    steps = []
    for answers in stats.answers:
        counts = Counter(answers)
        steps.append([[a, c] for a, c in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))])
    return {"steps": steps, "majority_answer": stats.majority_answer, "majority_share": stats.majority_share}
