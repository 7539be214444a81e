"""One table across online runs that differ only in their stream seed (the paper's 17, 42, 78).

Each run directory is read from disk (``run.json`` and ``records.jsonl``; nothing is recomputed
and no model is loaded). Runs are comparable when they used the same dataset, the same number of
questions and the same configuration; a setting recorded by every run with different values is
refused by name, because a mean over different settings answers no question. Settings that only
some runs recorded (added to the library after an older run) are listed, not refused.

Per method it reports each seed's accuracy, the mean and the spread (sample standard deviation,
min and max), the difference to the ``zero_shot`` method of the same run, and the gains and
losses against the method's own zero-shot candidate (ELM's), summed over seeds. Stream-memory runs
(``elm_stream``, ``elm_amortized``) also get their rows pooled over the runs' test halves, with the planned sign
tests over distinct questions.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elm_memory.environment import mixed_code_warning
from elm_memory.errors import ConfigError
from elm_memory.eval import amortized_report
from elm_memory.eval.metrics import summarize_online
from elm_memory.eval.paired import markdown_paired, paired_summaries
from elm_memory.eval.records import RecordLog
from elm_memory.eval.significance import head_to_head, markdown_head_to_head
from elm_memory.eval.stream_report import markdown_stream, stream_records, summarize_stream, warmup_of


@dataclass
class SeedRun:
    path: Path
    seed: int | None
    dataset: str
    questions: int
    config: dict[str, Any]
    summary: dict[str, dict[str, Any]]
    records: list[dict[str, Any]] = field(default_factory=list)
    code_versions: list[dict[str, Any]] = field(default_factory=list)  # run.json's: what code answered


@dataclass
class SeedComparison:
    runs: list[SeedRun]
    methods: dict[str, dict[str, Any]]  # method -> per-seed values and aggregates
    unrecorded: list[str] = field(default_factory=list)  # config keys only some runs recorded
    head_to_head: list[dict[str, Any]] = field(default_factory=list)  # pooled over runs, by distinct question
    paired: list[dict[str, Any]] = field(default_factory=list)  # eval.paired, pooled over runs
    stream: dict[str, Any] | None = None  # eval.stream_report, pooled over runs' test halves
    amortized: dict[str, Any] | None = None  # eval.amortized_report, pooled likewise

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": [
                {"path": str(r.path), "seed": r.seed, "questions": r.questions, "code_versions": r.code_versions}
                for r in self.runs
            ],
            "dataset": self.runs[0].dataset,
            "methods": self.methods,
            "config_keys_not_recorded_by_every_run": self.unrecorded,
            "head_to_head": self.head_to_head,
            "paired": self.paired,
            **({"stream": self.stream} if self.stream is not None else {}),
            **({"amortized": self.amortized} if self.amortized is not None else {}),
        }


def load_run(path: str | Path, first: int | None = None) -> SeedRun:
    """A finished or partial online run; its summary is recomputed from the records on disk.
    ``first``: only the run's first ``first`` questions (an online run is causal, so its first N
    questions are exactly what a run of N questions would have answered)."""
    directory = Path(path)
    manifest_path = directory / "run.json"
    if not manifest_path.is_file():
        raise ConfigError(f"{directory} is not an online run directory (no run.json)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{manifest_path} is not valid JSON: {exc}") from None
    records = RecordLog(directory / "records.jsonl").read()
    questions = len(manifest.get("question_ids", []))
    if first is not None:
        if first > questions:
            raise ConfigError(f"{directory} has {questions} questions, fewer than the first {first} asked for")
        records, questions = [r for r in records if r["index"] < first], first
    if not records:
        raise ConfigError(f"{directory} has no records yet")
    return SeedRun(
        path=directory,
        seed=manifest.get("seed"),
        dataset=str(manifest.get("dataset")),
        questions=questions,
        config=manifest.get("config", {}),
        summary=summarize_online(records),
        records=records,
        code_versions=list(manifest.get("code_versions") or []),
    )


def compare_seeds(paths: Sequence[str | Path], *, partial: bool = False, first: int | None = None) -> SeedComparison:
    """``partial``: accept runs that have not answered every question with every method (the
    mean is then over different question sets; each method's ``n`` per seed says how many).
    ``first``: compare the runs' first ``first`` questions only (e.g. a longer run with a stopped one)."""
    if first is not None and first < 1:
        raise ConfigError(f"first must be at least 1, got {first}")
    runs = [load_run(p, first) for p in paths]
    if len(runs) < 2:
        raise ConfigError("compare needs at least two run directories")
    base = runs[0]
    for run in runs[1:]:
        for name in ("dataset", "questions"):
            if getattr(run, name) != getattr(base, name):
                raise ConfigError(
                    f"runs differ in {name}: {base.path} has {getattr(base, name)!r}, "
                    f"{run.path} has {getattr(run, name)!r}"
                )
    seeds = [r.seed for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"two runs have the same seed ({seeds}): a seed mean needs distinct seeds")
    unrecorded = _check_configs(runs)
    methods = [m for m in base.summary if all(m in r.summary for r in runs)]
    if not methods:
        raise ConfigError("the runs have no method in common")
    for run in runs:
        for m in methods:
            done = run.summary[m]["n"]
            if done < run.questions and not partial:
                raise ConfigError(
                    f"{run.path} has {m} answers for {done} of its {run.questions} questions (still running, "
                    "or stopped): finish it by re-running its command, or compare partial runs on purpose"
                )
    return SeedComparison(
        runs=runs,
        methods={m: _method_row(m, runs) for m in methods},
        unrecorded=unrecorded,
        head_to_head=head_to_head([r.records for r in runs]),
        paired=paired_summaries([r.records for r in runs], methods, runs[0].config),  # one config: checked above
        stream=_pooled_stream(runs),
        amortized=_pooled_amortized(runs),
    )


def _pooled_stream(runs: Sequence[SeedRun]) -> dict[str, Any] | None:
    """Stream-memory runs: every row on the runs' test halves together (each run's second half of the questions it
    answered) and the planned sign tests over distinct questions."""
    if not all(stream_records(r.records) for r in runs):
        return None
    return summarize_stream([r.records for r in runs], warmup=[warmup_of(r.records) for r in runs])


def _pooled_amortized(runs: Sequence[SeedRun]) -> dict[str, Any] | None:
    """``elm_amortized`` runs: the same, with tokens per question, the gate and the labels."""
    if not all(amortized_report.amortized_records(r.records) for r in runs):
        return None
    return amortized_report.summarize_amortized(
        [r.records for r in runs], [amortized_report.warmup_of(r.records) for r in runs]
    )


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _check_configs(runs: Sequence[SeedRun]) -> list[str]:
    flats = [_flatten(r.config) for r in runs]
    common = set.intersection(*(set(f) for f in flats))
    for key in sorted(common):
        values = [f[key] for f in flats]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"{r.path.name}: {v!r}" for r, v in zip(runs, values, strict=True))
            raise ConfigError(f"runs differ in config {key} ({shown}): compare runs made with one configuration")
    return sorted(set.union(*(set(f) for f in flats)) - common)


def _method_row(method: str, runs: Sequence[SeedRun]) -> dict[str, Any]:
    acc = [r.summary[method]["accuracy"] for r in runs]
    n = [r.summary[method]["n"] for r in runs]
    row: dict[str, Any] = {
        "seeds": [r.seed for r in runs],
        "n": n,
        "accuracy": acc,
        "mean": statistics.fmean(acc),
        "std": statistics.stdev(acc),
        "min": min(acc),
        "max": max(acc),
    }
    if all("zero_shot" in r.summary for r in runs):
        deltas = [a - r.summary["zero_shot"]["accuracy"] for a, r in zip(acc, runs, strict=True)]
        row["delta_vs_zero_shot"] = deltas
        row["mean_delta_vs_zero_shot"] = statistics.fmean(deltas)
    gains = [r.summary[method].get("gains") for r in runs]
    losses = [r.summary[method].get("losses") for r in runs]
    if all(g is not None for g in gains) and all(x is not None for x in losses):
        row["gains"], row["losses"] = gains, losses
        row["total_gains"], row["total_losses"] = sum(gains), sum(losses)
    return row


def markdown_seeds(comparison: SeedComparison) -> str:
    """One row per method: accuracy per seed, mean ± std, range, difference to zero_shot, gains/losses."""
    seeds = [str(r.seed) for r in comparison.runs]
    header = ["method", *(f"seed {s} (%)" for s in seeds), "mean (%)", "std", "min-max", "vs zero_shot", "+/−"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for method, row in comparison.methods.items():
        delta = row.get("mean_delta_vs_zero_shot")
        cells = [
            method,
            *(f"{100 * a:.1f}" for a in row["accuracy"]),
            f"{100 * row['mean']:.1f}",
            f"{100 * row['std']:.1f}",
            f"{100 * row['min']:.1f}-{100 * row['max']:.1f}",
            "" if delta is None or method == "zero_shot" else f"{100 * delta:+.1f}",
            f"+{row['total_gains']}/−{row['total_losses']}" if "total_gains" in row and method != "zero_shot" else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    if comparison.head_to_head:
        table += (
            "\nPooled over the runs, each distinct question once (exact sign test, two-sided):\n\n"
            + markdown_head_to_head(comparison.head_to_head)
        )
    if comparison.paired:
        for p in comparison.paired:
            table += "\n" + markdown_paired(p)
    if comparison.stream is not None:
        table += "\n" + markdown_stream(comparison.stream)
    if comparison.amortized is not None:
        table += "\n" + amortized_report.markdown_amortized(comparison.amortized)
    if warning := mixed_code_warning([c for r in comparison.runs for c in r.code_versions]):
        table += f"\nWarning: these runs' {warning}\n"
    return table
