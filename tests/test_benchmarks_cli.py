"""Every benchmark runs as ``python -m benchmarks.NAME`` (``--help`` answers) and none edits ``sys.path``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_benchmarks_is_a_package_with_modules():
    assert (ROOT / "benchmarks" / "__init__.py").is_file()
    assert len(MODULES) >= 20  # a glob that found nothing would make the tests below vacuous


@pytest.mark.parametrize("name", MODULES)
def test_help_runs_as_a_module(name):
    # from the repository root, as the docs say; PYTHONPATH makes this checkout's elm_memory the one imported
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"python -m benchmarks.{name} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("name", MODULES)
def test_no_sys_path_edits(name):
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    edits = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]
    assert not edits, f"benchmarks/{name}.py uses sys.path on line(s) {edits}: import through the package instead"
