"""Blobs at an fsspec URL (``store.blob_url``: ``s3://bucket/elm``, ``gs://...``, ``memory://...``):
the memories' files on an object store shared by every machine, the index on a Chroma server.

The same content-addressed layout as :class:`~elm_memory.store.blobs.BlobStore`
(``root/ab/cd/<sha256>.safetensors``). An object store writes an object in one request, so a
blob is written straight to its final name (no temp file to clean up): a reader sees the whole
object or none. Reads re-hash as the folder store does. ``file://`` URLs and plain paths use the
folder store (its fsync + rename write order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.faults import point
from elm_memory.store.blobs import (
    _SHA_RE,
    SUFFIX,
    BlobStore,
    MissingBlobError,
    decode_header,
    header_length,
    sha256_hex,
)


def open_blobs(url: str) -> BlobStore:
    """The blob store for ``url``: the folder store for local paths, else :class:`FsspecBlobStore`."""
    if "://" not in url or url.startswith("file://"):
        return BlobStore(url.removeprefix("file://"))
    return FsspecBlobStore(url)


class FsspecBlobStore(BlobStore):
    """Content-addressed blobs on any fsspec filesystem (needs that filesystem's package, e.g. s3fs)."""

    def __init__(self, url: str):
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise StoreError("store.blob_url needs fsspec: pip install fsspec") from None
        try:
            self.fs, root = url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open blob location {url}: {exc}") from None
        self.url = url
        self.root_key = root.rstrip("/")
        self.root = self.root_key  # a key on the filesystem, not a local Path

    def key(self, sha: str) -> str:
        sha = self._check_sha(sha)
        return f"{self.root_key}/{sha[:2]}/{sha[2:4]}/{sha}{SUFFIX}"

    def path(self, sha: str) -> Any:
        return self.key(sha)

    def put(self, data: bytes) -> str:
        sha = sha256_hex(data)
        key = self.key(sha)
        try:
            if self.fs.exists(key) and self.fs.size(key) == len(data):
                return sha
            self.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(key, data)
        except OSError as exc:
            raise StoreError(f"cannot write blob {sha[:12]} to {self.url}: {exc}") from None
        point("blob.renamed")
        return sha

    def exists(self, sha: str) -> bool:
        return bool(self.fs.exists(self.key(sha)))

    def get(self, sha: str) -> bytes:
        try:
            data = self.fs.cat_file(self.key(sha))
        except FileNotFoundError:
            raise MissingBlobError(
                f"blob {sha[:12]} is missing from {self.url}; run `elm memories check --repair`"
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot read blob {sha[:12]}: {exc}") from None
        if sha256_hex(data) != sha:
            raise MemoryFormatError(f"blob {sha[:12]} is corrupt (its sha256 no longer matches its name)")
        return bytes(data)

    def read_header(self, sha: str) -> dict[str, Any]:
        key = self.key(sha)
        try:
            n = header_length(sha, self.fs.cat_file(key, start=0, end=8))
            raw = self.fs.cat_file(key, start=8, end=8 + n)
        except FileNotFoundError:
            raise MissingBlobError(f"blob {sha[:12]} is missing from {self.url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read blob {sha[:12]}: {exc}") from None
        return decode_header(sha, raw)

    def mtime(self, sha: str) -> float:
        try:
            info = self.fs.info(self.key(sha))
        except FileNotFoundError:
            raise MissingBlobError(f"blob {sha[:12]} is missing from {self.url}") from None
        for field in ("mtime", "LastModified", "created", "updated"):
            value = info.get(field)
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            if isinstance(value, int | float):
                return float(value)
        return time.time()

    def delete(self, sha: str) -> bool:
        key = self.key(sha)
        point("blob.delete")
        try:
            self.fs.rm_file(key)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete blob {sha[:12]}: {exc}") from None
        return True

    def __iter__(self) -> Iterator[str]:
        try:
            keys = self.fs.glob(f"{self.root_key}/??/??/*{SUFFIX}")
        except FileNotFoundError:
            return
        for key in keys:
            name = str(key).rsplit("/", 1)[-1][: -len(SUFFIX)]
            if _SHA_RE.match(name):
                yield name

    def temp_files(self, older_than: float = 0.0) -> list[Any]:
        return []  # objects are written in one request: there are no temp files
