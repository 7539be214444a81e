"""Content-addressed blob directory: one safetensors memory file per sha256 of its bytes.

Why content addressing: a blob's name proves its content (a read re-hashes and refuses a
file that changed on disk), rewriting the same bytes is a no-op, and a new version of
a memory gets a new name, so an index row never points at a half-replaced file.

Why this write order: bytes go to a temp file in the destination directory, are
fsynced, renamed over the final name (atomic on POSIX), then the directory is fsynced.
A crash leaves either the complete blob or a ``.tmp-*`` file that no reader ever
opens and that :meth:`BlobStore.temp_files` lets the store's check remove.

Layout: ``root/ab/cd/abcd....safetensors`` (two levels of 256 shards, so no directory
grows past a few thousand entries at millions of memories).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.faults import point

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


class MissingBlobError(StoreError):
    """An index row points to a blob that is not on disk (run `elm memories check --repair`)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    """Persist a rename/unlink in ``path`` itself (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class BlobStore:
    """A directory of immutable, content-addressed safetensors blobs."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser()

    # -- naming -----------------------------------------------------------------------
    @staticmethod
    def _check_sha(sha: str) -> str:
        if not isinstance(sha, str) or not _SHA_RE.match(sha):
            raise StoreError(f"invalid blob name {sha!r}: expected 64 lowercase hex characters")
        return sha

    def path(self, sha: str) -> Path:
        sha = self._check_sha(sha)
        return self.root / sha[:2] / sha[2:4] / f"{sha}{SUFFIX}"

    # -- write ------------------------------------------------------------------------
    def put(self, data: bytes) -> str:
        """Store ``data`` under its sha256 (temp file, fsync, atomic rename, dir fsync)."""
        sha = sha256_hex(data)
        final = self.path(sha)
        if final.is_file() and final.stat().st_size == len(data):
            return sha  # same name, same size: same content (a corrupt copy is caught on read)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=final.parent)
        except OSError as exc:
            raise StoreError(f"cannot write to blob directory {self.root}: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "wb") as fh:
                self._write(fh, data)
                point("blob.temp_written")
                fh.flush()
                os.fsync(fh.fileno())
                point("blob.fsynced")
            os.replace(tmp, final)
            point("blob.renamed")
        except OSError as exc:
            raise StoreError(f"cannot write blob {sha[:12]}: {exc.strerror or exc}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)  # only exists if something above failed
        _fsync_dir(final.parent)
        return sha

    @staticmethod
    def _write(fh: Any, data: bytes) -> None:
        """The single point where bytes hit the temp file (tests interrupt it here)."""
        fh.write(data)

    # -- read -------------------------------------------------------------------------
    def exists(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def get(self, sha: str) -> bytes:
        """The blob's bytes, verified against its name."""
        path = self.path(sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MissingBlobError(
                f"blob {sha[:12]} is missing from {self.root}; run `elm memories check --repair`"
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot read blob {sha[:12]}: {exc.strerror or exc}") from None
        if sha256_hex(data) != sha:
            raise MemoryFormatError(f"blob {sha[:12]} is corrupt (its sha256 no longer matches its name)")
        return data

    def read_header(self, sha: str) -> dict[str, Any]:
        """The safetensors JSON header (tensor names, shapes, metadata) without reading the tensors."""
        path = self.path(sha)
        try:
            with path.open("rb") as fh:
                raw = fh.read(header_length(sha, fh.read(8)))
        except FileNotFoundError:
            raise MissingBlobError(f"blob {sha[:12]} is missing from {self.root}") from None
        except OSError as exc:
            raise StoreError(f"cannot read blob {sha[:12]}: {exc.strerror or exc}") from None
        return decode_header(sha, raw)

    def mtime(self, sha: str) -> float:
        """When the blob was written (seconds since the epoch)."""
        return self.path(sha).stat().st_mtime

    # -- delete / enumerate ------------------------------------------------------------
    def delete(self, sha: str) -> bool:
        path = self.path(sha)
        point("blob.delete")
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete blob {sha[:12]}: {exc.strerror or exc}") from None
        _fsync_dir(path.parent)
        return True

    def __iter__(self) -> Iterator[str]:
        """Names (sha256) of all complete blobs."""
        if not self.root.is_dir():
            return
        for path in self.root.glob(f"??/??/*{SUFFIX}"):
            name = path.name[: -len(SUFFIX)]
            if _SHA_RE.match(name):
                yield name

    def temp_files(self, older_than: float = 0.0) -> list[Path]:
        """Leftovers of interrupted writes, at least ``older_than`` seconds old (a live writer's file is young)."""
        if not self.root.is_dir():
            return []
        cutoff = time.time() - older_than
        out = []
        for path in self.root.glob(f"??/??/{TEMP_PREFIX}*"):
            try:
                if path.stat().st_mtime <= cutoff:
                    out.append(path)
            except FileNotFoundError:
                continue
        return out


def header_length(sha: str, first8: bytes) -> int:
    """The JSON header's length from a safetensors file's first 8 bytes, refused when absurd."""
    n = int.from_bytes(first8, "little")
    if not 0 < n <= _MAX_HEADER:
        raise MemoryFormatError(f"blob {sha[:12]} has no valid safetensors header")
    return n


def decode_header(sha: str, raw: bytes) -> dict[str, Any]:
    """A safetensors JSON header, or a :class:`MemoryFormatError` naming the blob."""
    try:
        header = json.loads(raw)
    except ValueError:
        raise MemoryFormatError(f"blob {sha[:12]} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise MemoryFormatError(f"blob {sha[:12]} has a malformed safetensors header")
    return header
