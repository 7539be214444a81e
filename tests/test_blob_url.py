"""``store.blob_url``: memory files at an fsspec URL (issue #14: blobs on an object store shared by the
learners and the answerers). fsspec's in-memory filesystem stands in for s3:// or gs:// here."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from _fakes import fake_memory, fake_model_info

from elm_memory.config import ELMConfig
from elm_memory.store.blobs import BlobStore
from elm_memory.store.blobs_fsspec import FsspecBlobStore, open_blobs
from elm_memory.store.chroma import ChromaMemoryStore

pytest.importorskip("fsspec")


def test_open_blobs_picks_the_folder_store_for_local_paths(tmp_path: Path) -> None:
    assert type(open_blobs(str(tmp_path / "b"))) is BlobStore
    assert type(open_blobs(f"file://{tmp_path}/b")) is BlobStore
    assert isinstance(open_blobs("memory://elm-x/blobs"), FsspecBlobStore)


def test_store_with_blob_url_roundtrip_check_delete(tmp_path: Path) -> None:
    url = f"memory://elm-test-{uuid.uuid4().hex[:8]}/blobs"
    info = fake_model_info()
    store = ChromaMemoryStore(tmp_path / "store", model=info, blob_url=url)
    memories = [fake_memory(info, seed=i) for i in range(3)]
    store.put_many(memories)
    assert not (tmp_path / "store" / "blobs").exists()  # nothing local
    blobs = store.blobs
    assert isinstance(blobs, FsspecBlobStore) and len(list(blobs)) == 3
    for m in memories:
        got = store.get(m.id)
        assert got.id == m.id and bool((got.soft_prompt == m.soft_prompt).all())
    report = store.check()
    assert report.ok, report
    # a second process (another machine) with the same URL and index sees the same memories
    other = ChromaMemoryStore(tmp_path / "store", model=info, blob_url=url)
    assert sorted(r.id for r in other.list()) == sorted(m.id for m in memories)
    assert store.delete(memories[0].id)
    assert len(list(blobs)) == 2
    sha = next(iter(blobs))
    assert blobs.get(sha) and blobs.read_header(sha) and blobs.mtime(sha) > 0
    blobs.fs.pipe_file(blobs.key(sha), b"\x08" + bytes(40))  # corrupt it
    report = store.check(repair=True)
    assert sha in report.corrupt_blobs


def test_blob_url_is_a_store_setting() -> None:
    cfg = ELMConfig.load(overrides={"store": {"blob_url": "memory://elm/blobs"}})
    assert cfg.store.blob_url == "memory://elm/blobs"
