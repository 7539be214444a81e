"""One store location: every command resolves ``store.path`` with the same rule (config/location.py),
under ``$ELM_HOME`` or the user data directory, never under the current directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _fakes import fake_memory, fake_model_info
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.config import ELMConfig, StoreConfig
from elm_memory.config.location import data_home, resolve_store_path
from elm_memory.memory import TrainingStats
from elm_memory.store.chroma import ChromaMemoryStore


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ELM_HOME in a temporary folder, and a *different* current directory."""
    h = tmp_path / "home"
    monkeypatch.setenv("ELM_HOME", str(h))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return h


def test_resolution_rules(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert data_home() == home
    assert resolve_store_path(None) == resolve_store_path("") == home / "store"
    assert resolve_store_path("store-tiny") == home / "store-tiny"  # relative: under ELM_HOME, not the CWD
    assert resolve_store_path("/abs/s") == Path("/abs/s")
    assert resolve_store_path("~/s") == Path.home() / "s"
    monkeypatch.delenv("ELM_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "xdg"))
    assert resolve_store_path("store") == home / "xdg" / "elm-memory" / "store"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")  # the XDG spec: relative values are ignored
    assert resolve_store_path("store") == Path.home() / ".local" / "share" / "elm-memory" / "store"


def test_config_and_presets_resolve_under_elm_home(home: Path) -> None:
    assert StoreConfig().path == str(home / "store")
    assert ELMConfig.load().store.path == str(home / "store")
    assert ELMConfig.load(preset="cpu-demo").store.path == str(home / "store")  # same model as the defaults
    tiny = ELMConfig.load(preset="cpu-tiny").store.path
    assert tiny == str(home / "store-tiny")  # SmolLM2's memories apart from the default model's
    assert ELMConfig.load(preset="paper").store.path == str(home / "store-paper")
    assert ELMConfig.load(overrides={"store": {"path": "mine"}}).store.path == str(home / "mine")
    assert not any(Path.cwd().iterdir())  # nothing resolved (or created) under the current directory


def test_memories_cli_takes_preset_config_and_set(home: Path, tmp_path: Path) -> None:
    m = fake_memory(fake_model_info(), question="q0?", stats=TrainingStats())
    ChromaMemoryStore(home / "store-tiny").put(m)
    run = CliRunner().invoke
    res = run(memories_app, ["list", "--preset", "cpu-tiny", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in json.loads(res.stdout)] == [m.id]
    res = run(memories_app, ["list", "--set", "store.path=store-tiny", "--json"])
    assert [r["id"] for r in json.loads(res.stdout)] == [m.id]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("store:\n  path: store-tiny\n", encoding="utf-8")
    for cmd in (["show", m.id], ["check"]):
        res = run(memories_app, [*cmd, "--config", str(cfg_file), "--json"])
        assert res.exit_code == 0, res.output
    # the default store is another folder: nothing there
    res = run(memories_app, ["list"])
    assert res.exit_code == 2 and f"no memory store at {home / 'store'}" in res.output
    # --store is a path on the command line: relative to the current directory, and it wins
    os.symlink(home / "store-tiny", Path.cwd() / "here")
    res = run(memories_app, ["list", "--preset", "paper", "--store", "here", "--json"])
    assert [r["id"] for r in json.loads(res.stdout)] == [m.id]
    res = run(memories_app, ["delete", m.id, "--preset", "cpu-tiny"])
    assert res.exit_code == 0 and ChromaMemoryStore(home / "store-tiny").count() == 0
    res = run(memories_app, ["list", "--preset", "nope"])
    assert res.exit_code == 2 and "unknown preset 'nope'" in res.output
    res = run(memories_app, ["list", "--set", "store.kind=none"])
    assert res.exit_code == 2 and "store.kind is 'none'" in res.output


@pytest.mark.model
def test_learn_in_one_directory_list_in_another(tmp_path: Path) -> None:
    """The real CLI in subprocesses: `elm learn --preset cpu-tiny` run in one directory files the memory
    where `elm memories list --preset cpu-tiny` run in another directory finds it."""
    from elm_memory.models.prepare import elm_home, prepare_model

    prepare_model("packaged:smollm2-135m", verbose=False)  # reuse the prepared model, do not prepare it again
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(elm_home().resolve() / "models", target_is_directory=True)
    env = {**os.environ, "ELM_HOME": str(home)}
    env.pop("XDG_DATA_HOME", None)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()

    def elm(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "elm_memory.cli", *args]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)

    learned = elm(a, "learn", "What is 2 + 3?", "--preset", "cpu-tiny", "--set", "training.steps=0", "--json")
    assert learned.returncode == 0, learned.stderr
    memory_id = json.loads(learned.stdout.strip().splitlines()[-1])["memory_id"]
    assert list(a.iterdir()) == []  # nothing written under the working directory
    assert (home / "store-tiny" / "chroma").is_dir()

    listed = elm(b, "memories", "list", "--preset", "cpu-tiny", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["id"] for r in json.loads(listed.stdout)] == [memory_id]
    default = elm(b, "memories", "list")  # the default model's store: another folder, still empty
    assert default.returncode == 2 and default.stderr.startswith("error: no memory store at")
    assert list(b.iterdir()) == []
