"""The vendored benchmark files (MATH500, AMC23, AIME24, GSM8K test); see ``data/PROVENANCE.md``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

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
