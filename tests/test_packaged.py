"""Packaged-model plumbing: hash pinning, wheel reading, preparation."""

from __future__ import annotations

import hashlib
import json
import zipfile

import pytest

from elm_memory.errors import ModelIntegrityError, ModelNotFoundError
from elm_memory.models import packaged
from elm_memory.models.packaged import PackagedModel, WheelMember, assemble_gguf, get_packaged


def _fake_wheels(tmp_path, parts: list[bytes]):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    members = []
    for i, blob in enumerate(parts, 1):
        dist = f"fake-model-part{i}"
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(downloads / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, blob)
        members.append(WheelMember(dist, "1.0", member))
    return downloads, tuple(members)


def test_parts_are_concatenated_and_verified(tmp_path):
    blobs = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    downloads, members = _fake_wheels(tmp_path, blobs)
    whole = b"".join(blobs)
    model = PackagedModel("fake", members, hashlib.sha256(whole).hexdigest(), len(whole), "d", "p")
    out = assemble_gguf(model, tmp_path / "m.gguf", downloads)
    assert out.read_bytes() == whole


def test_wrong_hash_is_refused_and_leaves_nothing(tmp_path):
    downloads, members = _fake_wheels(tmp_path, [b"GGUF" + b"x" * 64])
    model = PackagedModel("fake", members, "0" * 64, 68, "d", "p")
    with pytest.raises(ModelIntegrityError, match="refusing to load"):
        assemble_gguf(model, tmp_path / "m.gguf", downloads)
    assert not (tmp_path / "m.gguf").exists()
    assert not list(tmp_path.glob("m.gguf*.part"))


def test_missing_member_is_a_typed_error(tmp_path):
    downloads, (member,) = _fake_wheels(tmp_path, [b"x"])
    broken = WheelMember(member.distribution, member.version, "not/in/the/wheel.bin")
    model = PackagedModel("fake", (broken,), "0" * 64, 1, "d", "p")
    with pytest.raises(ModelIntegrityError, match="not the expected wheel"):
        assemble_gguf(model, tmp_path / "m.gguf", downloads)


def test_unfetchable_wheel_is_a_typed_error(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found"

    monkeypatch.setattr(packaged.subprocess, "run", lambda *a, **k: Failed())
    model = PackagedModel("fake", (WheelMember("nope-dist", "9.9", "x.bin"),), "0" * 64, 1, "d", "p")
    with pytest.raises(ModelNotFoundError, match="could not fetch nope-dist==9.9"):
        assemble_gguf(model, tmp_path / "m.gguf", tmp_path / "dl")


def test_unknown_alias():
    assert get_packaged("packaged:smollm2-135m").sha256.startswith("b179c952")
    with pytest.raises(ModelNotFoundError, match="known: packaged:"):
        get_packaged("packaged:gpt-17")


@pytest.mark.model
def test_prepared_folder_is_a_plain_hf_model(tiny_loaded):
    from pathlib import Path

    folder = Path(tiny_loaded.info.path)
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "elm_model.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # TRL and vLLM must see a plain model
    meta = json.loads((folder / "elm_model.json").read_text())
    assert meta["source"]["sha256"] == get_packaged("packaged:smollm2-135m").sha256
    assert meta["embedding_fingerprint"] == tiny_loaded.info.fingerprint
    from elm_memory.models.fingerprint import embedding_fingerprint

    assert embedding_fingerprint(tiny_loaded.model) == tiny_loaded.info.fingerprint
    assert all(not p.requires_grad for p in tiny_loaded.model.parameters())  # frozen


def test_the_gguf_a_folder_was_prepared_from_is_found_or_the_reason_given(tmp_path, monkeypatch):
    from elm_memory.backends.llama_rows import missing
    from elm_memory.models.prepare import MARKER, source_gguf

    plain = tmp_path / "hf-folder"
    plain.mkdir()
    assert source_gguf(plain) == (None, f"{plain} was not prepared from a GGUF (no {MARKER})")
    monkeypatch.setattr("elm_memory.backends.llama_rows.available", lambda: None)
    assert missing(plain) == f"{plain} was not prepared from a GGUF"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder = tmp_path / "prepared"
    folder.mkdir()
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (folder / MARKER).write_text(json.dumps({"source": {"name": str(gguf), "sha256": sha}}))
    assert source_gguf(folder) == (gguf, str(gguf)) and missing(folder) is None
    gguf.write_bytes(b"GGUF" + bytes(61))  # changed since it was prepared
    assert source_gguf(folder)[0] is None and "changed since" in source_gguf(folder)[1]
    gguf.unlink()
    assert "is gone" in source_gguf(folder)[1]
    (folder / MARKER).write_text("{not json")
    assert source_gguf(folder)[0] is None and "unreadable" in source_gguf(folder)[1]
