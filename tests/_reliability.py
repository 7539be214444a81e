"""Counts of the reliability tests (#18: fault injection, isolation, soak) for the table in docs/testing.md.

Each test adds one row: test | runs | faults injected | inputs tried | lost | duplicated |
errors (typed / all). The rows are printed after the module (``reliability: ...`` lines) and,
with ``ELM_RELIABILITY_REPORT=FILE``, merged into that JSON file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest


@dataclass
class Row:
    runs: int = 0
    faults: int = 0
    inputs: int = 0
    lost: int = 0
    duplicated: int = 0
    errors: int = 0  # exceptions seen by the test's client code
    typed_errors: int = 0  # of which ELMError subclasses
    notes: dict[str, int] = field(default_factory=dict)

    def note(self, key: str, n: int = 1) -> None:
        self.notes[key] = self.notes.get(key, 0) + n


ROWS: dict[str, Row] = {}


def row(name: str) -> Row:
    return ROWS.setdefault(name, Row())


def report(request: pytest.FixtureRequest, names: list[str]) -> Iterator[None]:
    """Body of a module-scoped autouse fixture: print and save the rows of ``names`` after the module."""
    yield
    rows = {n: ROWS[n] for n in names if n in ROWS}
    if not rows:
        return
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            for n, r in rows.items():
                rate = f"{r.typed_errors}/{r.errors} typed" if r.errors else "no errors"
                extra = " ".join(f"{k}={v}" for k, v in sorted(r.notes.items()))
                reporter.write_line(
                    f"reliability: {n}: {r.runs} runs, {r.faults} faults, {r.inputs} inputs, "
                    f"{r.lost} lost, {r.duplicated} duplicated, {rate} {extra}".rstrip()
                )
    out = os.environ.get("ELM_RELIABILITY_REPORT")
    if out:
        path = Path(out)
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        saved.update({n: asdict(r) for n, r in rows.items()})
        path.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n", encoding="utf-8")
