"""The online protocol (paper Algorithm 1): one question at a time in a seeded order;
every method answers it, is scored, then learns from it (sync), before the next question.

Output directory::

    run.json        what was run (dataset, seed, question order, config, methods), on which machines
                    and with which code (elm-memory version, git commit)
    records.jsonl   one line per (method, question): answer, route, memory, scores, timings, and what
                    decided (the verifier's sample answers, the memory's training votes, the seeds)
    summary.json    per-method accuracy, routes, time split answer / learn, pool size on disk
    comparisons.json  ELM methods against the baselines (sign test), self-consistency counterfactuals
    results.md      the summary and the comparisons as Markdown tables
    *.png           accuracy over the stream, routes, memory-pool growth
    store/, pools/  the methods' memory pools (kept: a re-run resumes from them)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import Problem
from elm_memory.environment import code_version
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalMethod, EvalRuntime, build_method, open_runtime
from elm_memory.eval.progress import STREAM_LINE_SECONDS, ProgressBar
from elm_memory.eval.records import (
    RecordLog,
    check_manifest,
    config_defaults,
    machine_facts,
    run_dir,
    write_json_atomic,
)

#: Manifest fields that must match for a run to be resumed.
RESUME_FIELDS = ("dataset", "seed", "question_ids", "config")


@dataclass
class StreamResult:
    out_dir: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    plots: list[Path] = field(default_factory=list)
    table: str = ""


def run_stream(
    problems: Sequence[Problem],
    methods: Sequence[str],
    config: ELMConfig,
    out_dir: str | Path,
    *,
    dataset: str = "custom",
    seed: int | None = None,
    runtime: EvalRuntime | None = None,
    progress: bool | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    plots: bool = True,
    batch_size: int = 8,
    paired: bool = True,
) -> StreamResult:
    """Run (or resume) ``methods`` on ``problems`` in order; return the summary.

    Re-running with the same arguments and ``out_dir`` skips every (method, question)
    already recorded and continues with the memory pools as they were.

    ``paired``: ELM methods also record what :mod:`elm_memory.eval.paired` needs to give zero-shot,
    self-consistency, maj@k and the untrained memory on ELM's own generations (about one more greedy
    decode per question).

    Memoryless methods (``zero_shot``, ``verifier_at_2``: their answers do not depend on
    earlier questions) are answered first, ``batch_size`` questions per call, which is
    several times faster on a CPU; methods with a pool run one question at a time.
    """
    out = run_dir(out_dir)
    methods = _known_methods(methods)
    if not problems:
        raise ConfigError("no questions to run")
    manifest = check_manifest(
        out, _manifest(problems, methods, config, dataset, seed), RESUME_FIELDS, config_defaults()
    )
    log = RecordLog(out / "records.jsonl")
    recorded = log.read()
    done = {(r["method"], r["question_id"]) for r in recorded}
    todo = [(i, p, m) for i, p in enumerate(problems) for m in methods if (m, p.id) not in done]
    if todo:
        runtime, owns_runtime = open_runtime(config, out, runtime, paired=paired)
        built: dict[str, EvalMethod] = {}
        interrupted = False
        try:
            total = len(problems) * len(methods)
            # in a log, a line every STREAM_LINE_SECONDS with the time left, beside the records' own lines
            with ProgressBar(
                progress, total, len(done), lines=True, every=STREAM_LINE_SECONDS, phase_lines=False
            ) as bar:
                for m in methods:  # build all first: an error in any method shows before hours of work
                    built[m] = build_method(m, runtime)
                # a resumed run: what the methods recorded they may share, and pools rolled back to their
                # records (also with none: a run stopped in its first question may have stored its memory)
                for m, method in built.items():
                    resume = getattr(method, "resume", None)
                    if resume is not None:
                        resume([r for r in recorded if r["method"] == m])
                stream = _Stream(problems, runtime, built, log, bar, on_record)
                stream.run_batched([t for t in todo if _batchable(built[t[2]])], methods, batch_size)
                stream.run_in_order([t for t in todo if not _batchable(built[t[2]])])
        except (KeyboardInterrupt, SystemExit):
            interrupted = True
            raise
        finally:
            for method in built.values():
                # stopped by the user: leave queued learning queued (a resume redoes it) instead of running it now
                (getattr(method, "abandon", method.close) if interrupted else method.close)()
            if owns_runtime:
                runtime.close()
    return finish(out, manifest["methods"], plots=plots, config=manifest.get("config"))


def _known_methods(methods: Sequence[str]) -> list[str]:
    """The methods without repeats; unknown names fail here, before any model is loaded."""
    from elm_memory.eval.methods.registry import eval_methods

    names = list(dict.fromkeys(methods))
    if not names:
        raise ConfigError("no evaluation method given")
    for m in names:
        eval_methods.get(m)
    return names


def _manifest(
    problems: Sequence[Problem], methods: list[str], config: ELMConfig, dataset: str, seed: int | None
) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "seed": seed,
        "question_ids": [p.id for p in problems],
        "config": config.model_dump(mode="json"),
        "methods": methods,
        "machines": [machine_facts(config)],
        "code_versions": [code_version()],
    }


def _batchable(method: Any) -> bool:
    return bool(getattr(method, "memoryless", False)) and hasattr(method, "answer_batch")


class _Stream:
    """One run's loop state: where records go, the progress bar, and the built methods."""

    def __init__(
        self,
        problems: Sequence[Problem],
        runtime: EvalRuntime,
        built: dict[str, EvalMethod],
        log: RecordLog,
        bar: ProgressBar,
        on_record: Callable[[dict[str, Any]], None] | None,
    ):
        self.problems, self.runtime, self.built = problems, runtime, built
        self.log, self.bar, self.on_record = log, bar, on_record

    def save(self, record: dict[str, Any]) -> None:
        self.log.append(record)
        if self.on_record is not None:
            self.on_record(record)
        self.bar.advance()

    def run_batched(self, todo: list[tuple[int, Problem, str]], methods: list[str], batch_size: int) -> None:
        """Memoryless methods, method by method, ``batch_size`` questions per call."""
        n = len(self.problems)
        for m in methods:
            method: Any = self.built[m]
            mine = [(i, p) for i, p, mm in todo if mm == m]
            for start in range(0, len(mine), batch_size):
                chunk = mine[start : start + batch_size]
                self.bar.describe(f"{m} · questions {chunk[0][0] + 1}-{chunk[-1][0] + 1}/{n}")
                t0 = time.perf_counter()
                outputs = method.answer_batch([p.question for _, p in chunk], [i for i, _ in chunk])
                each = (time.perf_counter() - t0) / len(chunk)
                for (i, p), output in zip(chunk, outputs, strict=True):
                    record = _record(method, i, p, output, each, 0.0)
                    record["batched"] = len(chunk)  # answer time is the batch's share
                    self.save(record)

    def run_in_order(self, todo: list[tuple[int, Problem, str]]) -> None:
        """Methods with a pool: question by question, each answered, then learned from."""
        for i, p, m in todo:
            self.bar.describe(f"{m} · question {i + 1}/{len(self.problems)}")
            shared = self.runtime.shared_generations
            record = _run_one(self.built[m], i, p)
            # Greedy generations another method already made for this question (see eval/cache.py):
            # this method's answer time does not include them.
            record["shared_generations"] = self.runtime.shared_generations - shared
            self.save(record)


def _run_one(method: Any, index: int, problem: Problem) -> dict[str, Any]:
    if getattr(method, "overlap", False):  # a method that answers and learns side by side (ELM methods)
        output, t_answer, t_learn = method.answer_and_learn(problem.question, problem.id, index)
    else:
        t0 = time.perf_counter()
        output = method.answer(problem.question, index)
        t_answer = time.perf_counter() - t0
        if getattr(method, "uses_gold", False):  # an upper-bound arm: its label, after every row was drawn
            method.teach_gold(problem.question, problem.answer)
        t1 = time.perf_counter()
        method.learn(problem.question, problem.id, output)
        t_learn = time.perf_counter() - t1
    record = _record(method, index, problem, output, t_answer, t_learn)
    grade = getattr(method, "record_ground_truth", None)  # after answering and learning: gold never leaks in
    if grade is not None:
        grade(output, record["correct"])
        record["warnings"] = list(output.warnings)
    return record


def _record(method: Any, index: int, problem: Problem, output: Any, t_answer: float, t_learn: float) -> dict[str, Any]:
    correct = bool(equivalent(output.answer, problem.answer))  # scoring only: the method never sees the gold
    size, nbytes = method.pool_stats()
    return {
        "method": method.name,
        "index": index,
        "question_id": problem.id,
        "question": problem.question,
        "gold": problem.answer,
        "answer": output.answer,
        "correct": correct,
        "route": output.route,
        "memory_id": output.memory_id,
        "similarity": output.similarity,
        "candidates": [{**c, "correct": bool(equivalent(c.get("answer"), problem.answer))} for c in output.candidates],
        "response": output.response,
        "timings": {"answer": round(t_answer, 3), "learn": round(t_learn, 3)},
        "pool_size": size,
        "pool_bytes": nbytes,
        "warnings": list(output.warnings),
        "extra": output.extra,
        "finished_at": time.time(),
    }


def finish(
    out: Path, methods: Sequence[str], *, plots: bool = True, config: Mapping[str, Any] | None = None
) -> StreamResult:
    """Summary, Markdown table and plots from the records on disk (also for a partial run). ``config``: the
    run's (``run.json``), which says how its ELM records are replayed (:mod:`elm_memory.eval.paired`)."""
    from elm_memory.eval import amortized_report
    from elm_memory.eval.counterfactual import markdown_counterfactuals, self_consistency_counterfactual
    from elm_memory.eval.metrics import summarize_online
    from elm_memory.eval.paired import markdown_paired, paired_curves, paired_summaries
    from elm_memory.eval.report import markdown_online, plot_online
    from elm_memory.eval.significance import head_to_head, markdown_head_to_head
    from elm_memory.eval.stream_report import markdown_stream, plot_stream, stream_records, summarize_stream, warmup_of

    records = RecordLog(out / "records.jsonl").read()
    order = {m: n for n, m in enumerate(methods)}
    records.sort(key=lambda r: (order.get(r["method"], len(order)), r["index"]))
    summary = summarize_online(records) if records else {}
    summary = {m: summary[m] for m in methods if m in summary}
    table = markdown_online(summary) if summary else ""
    pairs = head_to_head([records])
    counterfactuals = [c for m in summary if m.startswith("elm_") if (c := self_consistency_counterfactual(records, m))]
    if pairs:
        table += "\nHead to head over distinct questions (exact sign test, two-sided):\n\n" + markdown_head_to_head(
            pairs
        )
    if counterfactuals:
        table += (
            "\nSelf-consistency counterfactual (greedy + the recorded verifier samples, majority, ties to greedy):\n\n"
            + markdown_counterfactuals(counterfactuals)
        )
    paired = paired_summaries([records], list(summary), config or {})
    for p in paired:
        table += "\n" + markdown_paired(p)
    stream = None
    if stream_records(records):  # a stream memory's rows: test part = the stream's second half
        stream = summarize_stream([records], warmup=warmup_of(records))
        table += "\n" + markdown_stream(stream)
    amortized = None
    if amortized_report.amortized_records(records):  # the amortized turn's rows: test part = the second half
        amortized_warmup = amortized_report.warmup_of(records)
        amortized = amortized_report.summarize_amortized([records], [amortized_warmup])
        table += amortized_report.markdown_amortized(amortized)
    write_json_atomic(out / "summary.json", summary)
    write_json_atomic(
        out / "comparisons.json",
        {
            "head_to_head": pairs,
            "self_consistency_counterfactual": counterfactuals,
            "paired": paired,
            **({"stream": stream} if stream is not None else {}),
            **({"amortized": amortized} if amortized is not None else {}),
        },
    )
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    written: list[Path] = []
    if plots and records:  # the paired curves are read only for the plot
        written = plot_online(records, out, paired_curves(records, list(summary), config or {}))
        if stream is not None and (path := plot_stream(records, out, warmup=stream["warmup"])) is not None:
            written.append(path)
        if amortized is not None:
            path = amortized_report.plot_amortized(records, out, warmup=amortized_warmup)
            written += [path] if path is not None else []
    return StreamResult(out_dir=out, summary=summary, records=records, plots=list(written), table=table)
