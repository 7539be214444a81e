"""The offline protocol (paper Sec. 5.1, Tables 1 and 2): one memory per question of a set,
each memory evaluated on the *whole* set (greedy pass@1).

It answers "can a single per-question memory generalise?", and how reliably: best and mean
memory accuracy, the fraction of memories that beat zero-shot, the oracle of zero-shot vs
memory per question, the negative flip rate of the top-5 memories and the IoU of the
questions the top-2 memories improve. ``memories_from`` evaluates a pool built by another
offline run (e.g. on another dataset): the paper's transfer setting.

Output directory::

    run.json          what was run
    zero_shot.jsonl   one line per question
    memories.jsonl    one line per memory: id, the question it was learned from, training stats
    evals.jsonl       one line per (memory, question)
    summary.json, results.md, memory_deltas.png, memory_accuracy.png
    store/            the memories (Chroma + safetensors), unless --memories-from

Every file is appended line by line and fsynced: re-running the same command resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import SamplingParams, answer_budget
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import Problem
from elm_memory.environment import code_version
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalRuntime, memory_store_config, open_runtime
from elm_memory.eval.progress import ProgressBar
from elm_memory.eval.records import (
    RecordLog,
    check_manifest,
    config_defaults,
    machine_facts,
    run_dir,
    training_votes,
    write_json_atomic,
)

NAMESPACE = "offline"
RESUME_FIELDS = ("dataset", "seed", "question_ids", "train_ids", "config", "memories_from")


@dataclass
class OfflineResult:
    out_dir: Path
    summary: dict[str, Any]
    table: str = ""
    plots: list[Path] = field(default_factory=list)


def run_offline(
    problems: Sequence[Problem],
    config: ELMConfig,
    out_dir: str | Path,
    *,
    dataset: str = "custom",
    seed: int | None = None,
    train: int | None = None,
    memories_from: str | Path | None = None,
    batch_size: int = 8,
    runtime: EvalRuntime | None = None,
    progress: bool | None = None,
    plots: bool = True,
) -> OfflineResult:
    """Learn a memory from each of the first ``train`` questions (all by default), or take the
    pool of ``memories_from``; evaluate zero-shot and every memory on every question."""
    out = run_dir(out_dir)
    if not problems:
        raise ConfigError("no questions to run")
    if batch_size < 1:
        raise ConfigError("batch_size must be at least 1")
    source = Path(memories_from) if memories_from is not None else None
    if source is not None and not (source / "memories.jsonl").is_file():
        raise ConfigError(f"{source} is not an offline run directory (no memories.jsonl)")
    memory_store_config(config, out, "the offline protocol")  # store.kind none: refused before any work
    train_set = list(problems[: train or len(problems)]) if source is None else []
    check_manifest(
        out,
        {
            "dataset": dataset,
            "seed": seed,
            "question_ids": [p.id for p in problems],
            "train_ids": [p.id for p in train_set],
            "config": config.model_dump(mode="json"),
            "memories_from": str(source.resolve()) if source else None,
            "methods": ["offline"],
            "machines": [machine_facts(config)],
            "code_versions": [code_version()],
        },
        RESUME_FIELDS,
        config_defaults(),
    )
    runtime, owns_runtime = open_runtime(config, out, runtime)
    try:
        _OfflineRun(runtime, out, source).run(problems, train_set, batch_size, progress)
    finally:
        if owns_runtime:
            runtime.close()
    return finish(out, memories_from=source, plots=plots)


class _OfflineRun:
    """One offline run: its three logs, and its phases (zero-shot, learning, evaluating memories)."""

    def __init__(self, runtime: EvalRuntime, out: Path, source: Path | None):
        self.runtime, self.out, self.source = runtime, out, source
        self.zs_log, self.mem_log, self.eval_log = (
            RecordLog(out / n) for n in ("zero_shot.jsonl", "memories.jsonl", "evals.jsonl")
        )

    def run(
        self, problems: Sequence[Problem], train_set: list[Problem], batch_size: int, progress: bool | None
    ) -> None:
        """Every phase, skipping what the logs already hold (a re-run resumes)."""
        zs_done = {r["question_id"] for r in self.zs_log.read()}
        pool_log = RecordLog(self.source / "memories.jsonl") if self.source else self.mem_log
        memories = {r["memory_id"]: r for r in pool_log.read()}
        learned = {r["question_id"] for r in memories.values()}
        evaluated = {(r["memory_id"], r["question_id"]) for r in self.eval_log.read()}
        todo_zs = [p for p in problems if p.id not in zs_done]
        todo_train = [p for p in train_set if p.id not in learned]
        n_mem = len(memories) + len(todo_train)
        total = len(problems) * (1 + n_mem) + len(train_set)
        done = len(problems) - len(todo_zs) + len(train_set) - len(todo_train) + len(evaluated)
        self.evals_total, self.evals_done = len(problems) * n_mem, len(evaluated)
        # lines: offline phases take many minutes each, so a log also gets a line per phase and every 30 s
        with ProgressBar(progress, total=total, completed=done, lines=True) as bar:
            self.zero_shot(todo_zs, batch_size, bar)
            if todo_train:
                self.learn(todo_train, memories, n_mem, bar)
            self.evaluate(problems, memories, evaluated, batch_size, bar)

    def zero_shot(self, todo: list[Problem], batch_size: int, bar: ProgressBar) -> None:
        bar.describe("zero-shot")
        for chunk in _chunks(todo, batch_size):
            for p, (answer, text) in zip(chunk, _answers(self.runtime, chunk, None), strict=True):
                correct = bool(equivalent(answer, p.answer))
                self.zs_log.append(
                    {"question_id": p.id, "answer": answer, "correct": correct, "gold": p.answer, "response": text}
                )
                bar.advance()

    def learn(self, todo: list[Problem], memories: dict[str, dict[str, Any]], n_mem: int, bar: ProgressBar) -> None:
        """One memory per question; learner.batch_size memories train together (each equal to the
        memory trained alone). ``memories`` gains a row per memory."""
        elm = _learning_elm(self.runtime, self.out)
        for batch in _chunks(todo, self.runtime.config.learner.batch_size):
            first = len(memories) + 1
            span = f"{first}" if len(batch) == 1 else f"{first}-{first + len(batch) - 1}"
            what = f"learning memory {span}/{n_mem} ({first - 1} done)"
            bar.describe(f"{what} · evaluations 0/{self.evals_total}")

            def stepped(done: int, steps: int, what: str = what) -> None:
                # a batch of memories can learn for many minutes: a line per step shows it is moving
                bar.describe(f"{what}, step {done}/{steps} · evaluations 0/{self.evals_total}")

            learned_batch = elm.learn_many(
                [p.question for p in batch], namespace=NAMESPACE, progress=False, on_step=stepped
            )
            for p, memory in zip(batch, learned_batch, strict=True):
                s = memory.meta.stats
                row = {
                    "memory_id": memory.id,
                    "question_id": p.id,
                    "question": p.question,
                    "majority_answer": s.majority_answer,
                    "majority_share": s.majority_share,
                    "votes": training_votes(s)["steps"],
                    "skipped_backward": s.skipped_backward,
                    "mean_reward": s.mean_reward,
                    "no_consensus": s.no_consensus,
                    "seconds": s.seconds,
                }
                self.mem_log.append(row)
                memories[memory.id] = row
                bar.advance()

    def evaluate(
        self,
        problems: Sequence[Problem],
        memories: dict[str, dict[str, Any]],
        evaluated: set[tuple[str, str]],
        batch_size: int,
        bar: ProgressBar,
    ) -> None:
        """Every memory on every question it has not been evaluated on, greedy, batched."""
        store = None  # opened on first need: a finished run loads no model
        for i, (mid, row) in enumerate(memories.items(), 1):
            todo = [p for p in problems if (mid, p.id) not in evaluated]
            if not todo:
                continue
            if store is None:
                store = _store(self.runtime, self.source or self.out)
            bar.describe(
                f"evaluating memory {i}/{len(memories)} · memories {len(memories)}/{len(memories)} learned "
                f"· evaluations {self.evals_done}/{self.evals_total}"
            )
            memory = store.get(mid, NAMESPACE)
            memory.check_compatible(self.runtime.backend.info)
            for chunk in _chunks(todo, batch_size):
                for p, (answer, _text) in zip(chunk, _answers(self.runtime, chunk, memory), strict=True):
                    self.eval_log.append(
                        {
                            "memory_id": mid,
                            "source_question_id": row["question_id"],
                            "question_id": p.id,
                            "answer": answer,
                            "correct": bool(equivalent(answer, p.answer)),
                        }
                    )
                    self.evals_done += 1
                    bar.advance()


def read_correctness(
    out: Path, memories_from: Path | None = None
) -> tuple[dict[str, bool], dict[str, dict[str, bool]]]:
    """An offline run's files as (zero-shot right per question, each memory's right per question), memories
    labelled by the question they were learned from (readable in tables and plots)."""
    zs = {r["question_id"]: bool(r["correct"]) for r in RecordLog(out / "zero_shot.jsonl").read()}
    labels = {r["memory_id"]: r["question_id"] for r in RecordLog((memories_from or out) / "memories.jsonl").read()}
    per_memory: dict[str, dict[str, bool]] = {}
    for r in RecordLog(out / "evals.jsonl").read():
        per_memory.setdefault(labels.get(r["memory_id"], r["memory_id"]), {})[r["question_id"]] = bool(r["correct"])
    return zs, per_memory


def finish(out: Path, *, memories_from: Path | None = None, plots: bool = True) -> OfflineResult:
    from elm_memory.eval.metrics import summarize_offline
    from elm_memory.eval.report import markdown_offline, plot_offline

    summary = summarize_offline(*read_correctness(out, memories_from))
    summary["memories_from"] = str(memories_from) if memories_from else None
    table = markdown_offline(summary)
    write_json_atomic(out / "summary.json", summary)
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    written = plot_offline(summary, out) if plots else []
    return OfflineResult(out_dir=out, summary=summary, table=table, plots=list(written))


def _chunks(items: Sequence[Problem], n: int) -> list[list[Problem]]:
    return [list(items[i : i + n]) for i in range(0, len(items), n)]


def _answers(runtime: EvalRuntime, problems: Sequence[Problem], memory: Any) -> list[tuple[str | None, str]]:
    return greedy_answers(runtime.config, runtime.prompts, runtime.backend, problems, memory)


def greedy_answers(
    cfg: ELMConfig, prompts: Any, backend: Any, problems: Sequence[Problem], memory: Any = None
) -> list[tuple[str | None, str]]:
    """Greedy (answer, response) to ``problems`` in one batched call of ``backend``, with ``memory`` (a soft
    prompt, or a lora/prefix memory's adapter) or none; also what the full-model protocol answers with (its
    own backend on the trained copy)."""
    k = cfg.memory.num_tokens
    inputs, longest = [], 0
    for p in problems:
        prompt = prompts.answer_prompt(p.question, memory_tokens=k)
        longest = max(longest, len(prompt.token_ids))
        inputs.append(prompt.zero_shot() if memory is None else prompt.for_memory(memory))  # any memory.kind
    g = cfg.generation
    budget = answer_budget(g.max_new_tokens, backend.info.max_context, longest, k if memory is not None else 0)
    params = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_at_answer=g.stop_at_answer)
    return [(extract_answer(gen.text), gen.text) for [gen] in backend.generate(inputs, params)]


def _learning_elm(runtime: EvalRuntime, out: Path) -> Any:
    from elm_memory.elm import ELM

    cfg = memory_store_config(runtime.config, out, "the offline protocol")
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"mode": "off"})})
    return ELM(cfg, loaded=runtime.loaded, backend=runtime.backend)


def _store(runtime: EvalRuntime, run_directory: Path) -> Any:
    """The pool of ``run_directory`` (this run's, or the one given by ``memories_from``)."""
    from elm_memory.store.registry import stores

    cfg = memory_store_config(runtime.config, run_dir(run_directory), "the offline protocol")
    return stores.get(cfg.store.kind).from_config(cfg.store, model=runtime.loaded.info)
