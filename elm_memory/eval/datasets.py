"""Benchmark questions: the vendored files (MATH500, AMC23, AIME24, GSM8K test; see
``data/PROVENANCE.md``) or any JSONL with ``question`` and ``answer`` fields.

Gold answers are carried only so the runner can score; no method ever receives them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from elm_memory.errors import ConfigError

DATASETS = {"math500": "math500.jsonl", "amc23": "amc23.jsonl", "aime24": "aime24.jsonl", "gsm8k": "gsm8k_test.jsonl"}


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str


def load_dataset(name: str, limit: int | None = None, offset: int = 0) -> list[Problem]:
    """Rows of a vendored benchmark, in upstream order."""
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    text = resources.files("elm_memory.eval").joinpath("data", DATASETS[name]).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = rows[offset : None if limit is None else offset + limit]
    return [Problem(r["id"], r["question"], r["answer"]) for r in rows]


def load_jsonl(path: str | Path) -> list[Problem]:
    """Any JSONL file with ``question`` and ``answer`` fields (``id`` optional: ``<stem>-<line>``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset file not found: {path}")
    problems: list[Problem] = []
    seen: set[str] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            raise ConfigError(f"{path}:{n}: each line needs a 'question' string and an 'answer'")
        pid = str(row.get("id", f"{path.stem}-{n}"))
        if pid in seen:
            raise ConfigError(f"{path}:{n}: duplicate id {pid!r}")
        seen.add(pid)
        problems.append(Problem(pid, row["question"], str(row["answer"])))
    if not problems:
        raise ConfigError(f"{path}: no questions")
    return problems


def load_problems(source: str, *, limit: int | None = None, seed: int | None = None) -> list[Problem]:
    """A vendored dataset name or a JSONL path; shuffled by ``seed`` (None: file order), then cut to ``limit``.

    Shuffling before cutting means ``--limit 10 --seed 17`` is a sample of the whole set,
    and the same seed always gives the same stream.
    """
    if source not in DATASETS and not Path(source).exists():
        raise ConfigError(f"unknown dataset {source!r}: neither a vendored name ({', '.join(DATASETS)}) nor a file")
    problems = load_dataset(source) if source in DATASETS else load_jsonl(source)
    if seed is not None:
        random.Random(seed).shuffle(problems)
    if limit is not None:
        if limit < 1:
            raise ConfigError("limit must be at least 1")
        problems = problems[:limit]
    return problems
