"""The wheel installs everything under ``elm_memory`` (no top-level ``graphs``/``integrations``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    conf = _setuptools()
    mapped = {name: ROOT / folder for name, folder in conf["package-dir"].items() if name}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "elm_memory").rglob("__init__.py")}
    for name, folder in mapped.items():
        found |= {
            name + "".join("." + part for part in p.parent.relative_to(folder).parts)
            for p in folder.rglob("__init__.py")
        }
    assert set(conf["packages"]) == found


def test_wheel_has_no_top_level_graphs_or_integrations(tmp_path):
    # built from a copy: a stale build/ folder in the checkout must not hide or add files
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "elm-runs", "site"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("elm_memory-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"elm_memory"}
    assert "elm_memory/graphs/elm_graph.py" in names and "elm_memory/integrations/tools.py" in names
    assert "elm_memory/presets/cpu-tiny.yaml" in names and "elm_memory/eval/data/gsm8k_test.jsonl" in names
    # PEP 561 marker: without it users' type checkers ignore the annotations
    assert "elm_memory/py.typed" in names
