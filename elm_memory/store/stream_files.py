"""Where a stream memory's versions live: one folder per namespace, one file per version, and a pointer.

::

    <root>/<namespace folder>/   (the namespace made safe as a folder name, plus its hash: see folder_name)
        v000007.safetensors        the memory (a LatentMemory file: tensors + metadata, its own history entry)
        v000007.optim.safetensors  its optimizer's moments, so another process continues the same run
                                   (the newest MOMENTS_KEPT versions only: see prune_moments)
        CURRENT                    the version that serves ("7"), replaced atomically
        history.jsonl              every update, rollback and gate decision, one JSON line each, appended
        gate.json                  the amortization gate's state (stream.serving: amortized)
        pending.json               what learning holds since the serving version: the guard's readings and the
                                   questions pooled for the next update, so a restarted process loses neither
        .lock                      held by whoever writes a version

Every update writes a new version and only then moves ``CURRENT``: until the new file is durable the previous
version serves, and a crash mid-write leaves at most an orphan file that is never served. Versions are never
rewritten; a rollback is a new version holding an earlier one's tensor. :func:`delete_stream` removes them all (the
next learner starts again at version 0). :meth:`StreamFiles.prune` deletes all but the newest versions
(``stream.keep_versions``) and the ones pinned (the version the gate approved): the history lives in its own
append-only log, so pruning loses no record, and a version's header stays the same size however long the stream.
The log is appended after ``CURRENT`` moves; a crash in between loses no entry, since the serving version's
header holds its own and :meth:`StreamFiles.read_history` adds it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from elm_memory.atomic import write_bytes_atomic
from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import validate_namespace

_VERSION = re.compile(r"^v(\d{6})\.safetensors$")
HISTORY_FILE = "history.jsonl"
GATE_FILE = "gate.json"
PENDING_FILE = "pending.json"
#: Versions whose optimizer moments are kept: a resumed evaluation restores at most the version before the newest
#: (its last record's), and a rollback starts a fresh optimizer; a LoRA's moments are twice its own size.
MOMENTS_KEPT = 2


class StreamFiles:
    """The version files of one namespace's stream memory."""

    def __init__(self, root: str | Path, namespace: str, *, lock_timeout: float = 600.0):
        self.namespace = validate_namespace(namespace)
        self.dir = Path(root).expanduser() / folder_name(self.namespace)
        self.lock_timeout = lock_timeout

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialises writers (threads and processes): an update reads the newest version and writes the next
        one under this lock, so no update is lost and none is applied twice."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.dir / ".lock"), timeout=self.lock_timeout):
            yield

    def current_version(self) -> int | None:
        """The version that serves, or None before the first write."""
        try:
            text = (self.dir / "CURRENT").read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise MemoryFormatError(f"stream memory {self.dir}: CURRENT holds {text!r}, not a version number")
        return int(text)

    def versions(self) -> list[int]:
        """Every version written (served or not), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _VERSION.match(p.name)))

    def path(self, version: int) -> Path:
        return self.dir / f"v{version:06d}.safetensors"

    def read(self, version: int | None = None) -> tuple[LatentMemory, dict[str, torch.Tensor]]:
        """A version's memory and optimizer tensors (``version`` None: the current one)."""
        if version is None:
            version = self.current_version()
            if version is None:
                raise MemoryFormatError(f"stream memory {self.dir} has no version yet")
        if not self.path(version).exists():
            kept = self.versions()
            span = f"v{kept[0]}..v{kept[-1]}" if kept else "none"
            raise MemoryFormatError(
                f"stream memory {self.dir} has no version {version} on disk (pruned by stream.keep_versions, or "
                f"never written); kept: {span}"
            )
        memory = LatentMemory.load(self.path(version))
        try:  # a version's moments may be pruned (prune_moments) at any time by a learner holding the lock
            optim = load_tensors(self.path(version).with_suffix(".optim.safetensors").read_bytes())
        except FileNotFoundError:
            optim = {}
        return memory, optim

    def write(self, version: int, memory: LatentMemory, optim: dict[str, torch.Tensor]) -> Path:
        """Write ``version`` durably, then make it the one that serves. Call under :meth:`lock`."""
        current = self.current_version()
        if current is not None and version <= current:
            raise MemoryFormatError(f"stream memory {self.dir}: version {version} is not after {current}")
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(version)
        write_bytes_atomic(
            path.with_suffix(".optim.safetensors"), save_tensors({k: v.contiguous() for k, v in optim.items()})
        )
        memory.save(path)
        write_bytes_atomic(self.dir / "CURRENT", f"{version}\n".encode("ascii"))
        return path

    # -- the history log and the gate's state ----------------------------------------------------
    def append_history(self, entries: list[dict[str, Any]]) -> None:
        """Append entries to the history log, durably (a tail cut short by a crash is dropped first). Call under
        :meth:`lock`."""
        if not entries:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._drop_cut_tail()
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries).encode()
        with open(self.dir / HISTORY_FILE, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _drop_cut_tail(self) -> None:
        path = self.dir / HISTORY_FILE
        if not path.exists():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def read_history(self, serving: LatentMemory | None = None) -> list[dict[str, Any]]:
        """Every entry of the log, oldest first (a pure read). A last line cut short by a crash is left out;
        ``serving`` (the current version's memory) adds its own entry when the log lost it (:meth:`repair_history`
        writes it back). Files written before the log existed carry the whole history in their header: that is
        read instead."""
        path = self.dir / HISTORY_FILE
        entries: list[dict[str, Any]] = []
        if path.exists():
            data = path.read_bytes()
            complete = data[: data.rfind(b"\n") + 1]  # a crash mid-append leaves at most one cut line, last
            for i, line in enumerate(complete.split(b"\n")):
                if line.strip():
                    try:
                        entries.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise MemoryFormatError(f"stream memory {path}: line {i + 1} is not JSON") from None
        meta = (serving.meta.config.get("stream", {}) if serving is not None else {}) or {}
        if not entries and meta.get("history"):
            return list(meta["history"])  # an older file: the header held the whole history
        own = meta.get("entry")
        if own is not None and not any(e.get("version") == own.get("version") for e in entries):
            entries.append(own)
        return entries

    def repair_history(self, serving: LatentMemory) -> list[dict[str, Any]]:
        """:meth:`read_history`, writing back what it recovered (the serving version's own entry; an older file's
        whole history, so the log holds it from now on). Call under :meth:`lock`."""
        path = self.dir / HISTORY_FILE
        logged = path.read_bytes().count(b"\n") if path.exists() else 0  # complete lines; the log is read once
        entries = self.read_history(serving)
        if len(entries) > logged:
            self.append_history(entries[logged:])
        return entries

    def _read_json(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.dir / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise MemoryFormatError(f"stream memory {self.dir}: {name} is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise MemoryFormatError(f"stream memory {self.dir}: {name} is not a JSON object")
        return data

    def _write_json(self, name: str, state: dict[str, Any], indent: int | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.dir / name, json.dumps(state, indent=indent).encode())

    def read_gate(self) -> dict[str, Any] | None:
        """The gate's stored state (None: never written)."""
        return self._read_json(GATE_FILE)

    def write_gate(self, state: dict[str, Any]) -> None:
        """Replace the gate's state atomically. Call under :meth:`lock`."""
        self._write_json(GATE_FILE, state, indent=1)

    def read_pending(self, version: int) -> dict[str, Any] | None:
        """What learning held since ``version`` (``{"version": V, "guard": {...}, "pooled": [...]}``; None: nothing
        since it, since a version is written only with an empty pool and the guard's state in its own header)."""
        held = self._read_json(PENDING_FILE)
        if held is not None and not (
            isinstance(held.get("version"), int)
            and isinstance(held.get("guard"), dict)
            and isinstance(held.get("pooled"), list)
        ):
            raise MemoryFormatError(
                f"stream memory {self.dir}: {PENDING_FILE} lacks its version, guard or pooled questions; delete it to "
                "continue from the serving version without what it held"
            )
        return held if held is not None and held["version"] == version else None

    def write_pending(self, state: dict[str, Any]) -> None:
        """Replace what learning holds since ``state["version"]``, atomically. Call under :meth:`lock`."""
        self._write_json(PENDING_FILE, state)

    def restore_gate(self, state: dict[str, Any], *, reason: str, at_version: int) -> dict[str, Any] | None:
        """Write ``state`` as the gate's and log why in the history (call under :meth:`lock`); the history entry, or
        None when the gate on disk is ``state`` already."""
        stored = self.read_gate() or {}
        if stored == state:
            return None
        entry = {
            "gate_restored": {
                "state": [stored.get("state"), state.get("state")],
                "readings": [stored.get("total_readings", 0), state.get("total_readings", 0)],
            },
            "at_version": at_version,
            "reasons": [reason],
        }
        self.write_gate(state)
        self.append_history([entry])
        return entry

    def delete(self) -> list[int]:
        """Delete the pointer, then every version, the log, the gate and what learning held (the lock file stays).
        Call under :meth:`lock`."""
        removed = self.versions()
        (self.dir / "CURRENT").unlink(missing_ok=True)  # first: from here on no version serves
        for name in (HISTORY_FILE, GATE_FILE, PENDING_FILE):
            (self.dir / name).unlink(missing_ok=True)
        for version in removed:
            path = self.path(version)
            path.with_suffix(".optim.safetensors").unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        return removed

    def prune_moments(self, keep: int = MOMENTS_KEPT) -> list[int]:
        """Delete the optimizer moments of every version but the newest ``keep`` (and the one that serves); the
        memories stay. A version without moments continues with a fresh optimizer. ``keep`` <= 0 keeps all, as
        in :meth:`prune`. Call under :meth:`lock`."""
        if keep <= 0:
            return []
        current = self.current_version()
        dropped = []
        for version in self.versions()[:-keep]:
            moments = self.path(version).with_suffix(".optim.safetensors")
            if version != current and moments.exists():
                moments.unlink()
                dropped.append(version)
        return dropped

    def prune(self, keep: int, pinned: set[int] | None = None) -> list[int]:
        """Delete every version but the newest ``keep``, the one that serves and the ``pinned`` ones (the version
        the gate approved). Call under :meth:`lock`."""
        if keep <= 0:
            return []
        current = self.current_version()
        spared = {current, *(pinned or ())}
        doomed = [v for v in self.versions()[:-keep] if v not in spared]
        for version in doomed:
            path = self.path(version)
            path.with_suffix(".optim.safetensors").unlink(missing_ok=True)
            path.unlink(missing_ok=True)  # the memory last: an optimizer file without it is never read
        return doomed


def delete_stream(root: str | Path, namespace: str) -> list[int]:
    """Delete one namespace's stream memory, every version (``elm memories delete --stream``); the versions that
    were on disk. Its next learner starts again from the untrained memory, as a new one would."""
    files = StreamFiles(root, namespace)
    if files.current_version() is None:
        raise StoreError(f"namespace {namespace!r} has no stream memory under {files.dir.parent}")
    with files.lock():
        return files.delete()


def stream_root(store_path: str | Path | None) -> Path:
    """Where a store keeps its stream memories: ``<store folder>/stream`` (``store.path`` as configured)."""
    from elm_memory.config.location import resolve_store_path

    return resolve_store_path(store_path) / "stream"


def list_streams(root: str | Path) -> list[dict[str, Any]]:
    """Every stream memory under ``root``: namespace, serving version, versions written, updates, rollbacks, the gate,
    what learning holds since the version (questions pooled, the guard's readings) and the serving file (read from
    the files alone, no model)."""
    out = []
    base = Path(root).expanduser()
    for current in sorted(base.glob("*/CURRENT")):
        version = int(current.read_text(encoding="ascii").strip())
        path = current.parent / f"v{version:06d}.safetensors"
        memory = LatentMemory.load(path)
        meta = memory.meta
        stream = meta.config.get("stream", {})
        files = StreamFiles(base, meta.namespace)
        history = files.read_history(memory)
        gate = files.read_gate()
        held = files.read_pending(version) or {"guard": stream.get("guard") or {}, "pooled": []}
        tuning = stream.get("recipe", {}).get("tuning", {})
        out.append(
            {
                "namespace": meta.namespace,
                "version": version,
                "versions_written": version + 1,  # numbered from v0 (the init), one per write
                "versions_kept": sum(bool(_VERSION.match(p.name)) for p in current.parent.iterdir()),
                "kind": meta.kind,
                "objective": stream.get("objective"),
                **updates_and_rollbacks(history),
                "serving": stream.get("recipe", {}).get("serving", "vote"),
                "gate": gate_summary(gate, history),
                "pending": {
                    "pooled": len(held["pooled"]),
                    "update_every": tuning.get("update_every", 1),
                    "guard_readings": len(held["guard"].get("pending", [])),
                    "guard_window": tuning.get("guard_window"),
                },
                "created_at": meta.created_at,
                "path": str(path),
            }
        )
    return out


def updates_and_rollbacks(history: list[dict[str, Any]]) -> dict[str, Any]:
    """What a version's history says happened: how many updates trained it (an entry with a label; a pooled
    batch counts once) and each rollback with its target and reasons."""
    return {
        "updates": sum("label" in h for h in history),
        "rollbacks": [
            {"version": h["version"], "to": h["rollback_to"], "reasons": h.get("reasons", [])}
            for h in history
            if h.get("rollback_to") is not None
        ],
    }


def gate_summary(gate: dict[str, Any] | None, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The gate's state, every decision it made with why, and every time a resumed evaluation put it back (None: no
    gate ran)."""
    if gate is None:
        return None
    return {
        "state": gate.get("state"),
        "approved_version": gate.get("approved_version"),
        "readings": gate.get("total_readings", 0),
        "outcomes": gate.get("counts", {}),
        "decisions": [h["gate"] for h in history if "gate" in h],
        "restored": [{**h["gate_restored"], "reasons": h.get("reasons", [])} for h in history if "gate_restored" in h],
    }


def folder_name(namespace: str) -> str:
    """A namespace as one safe folder name: its letters and digits (others as ``_``), then a hash of the whole,
    so ``a/b`` and ``a_b`` stay apart and no namespace can name a path outside the root."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", namespace)[:64]
    return f"{safe}-{hashlib.sha256(namespace.encode()).hexdigest()[:12]}"
