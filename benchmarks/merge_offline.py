"""Merging on the offline protocol (#16 item 4): unmerged pool vs ``average``- vs ``train``-merged pools.

    python -m benchmarks.merge_offline                    # cpu-demo preset, 3 near-duplicate pairs + 2 singles
    python -m benchmarks.merge_offline --pairs 1 --singles 1 --out /tmp/m   # a quick look

Questions: synth-arith (the toy stream, ``elm_memory/eval/synth.py``). Among its first 60 questions,
``--pairs`` clusters of two whose input keys reach ``--threshold`` on the default model (same
template, other numbers), plus ``--singles`` questions near no other: the set. One memory per
question is learned with the preset's recipe (cpu-demo: S=1, G=4) into the unmerged pool; copies
of it are merged with each strategy (``train``: ``--merge-steps`` GRPO steps, the preset's G).

Per pool, as the offline protocol does, every memory answers every question of the set greedily;
reported: zero-shot accuracy, mean and best memory accuracy over the whole set, and top-1 accuracy
(each question answered with the memory retrieval picks from that pool: input keys, cosine).
``--top1-only`` answers each question only with its picked memory (one batched call per pool). Every
generation is logged to ``answers.jsonl`` in ``--out``; ``summary.json`` holds the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import SamplingParams, answer_budget
from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.eval.synth import generate
from elm_memory.memory import LatentMemory
from elm_memory.store.chroma import ChromaMemoryStore
from elm_memory.store.merge import average_memory, cluster_keys, find_clusters, merge_clusters
from elm_memory.training.merging import train_merged

ROOT = Path(__file__).resolve().parents[1]

NAMESPACE = "offline"


def pick_questions(elm: ELM, pairs: int, singles: int, threshold: float) -> list[Any]:
    """``pairs`` near-duplicate pairs and ``singles`` questions near no other, from synth-arith's first 60."""
    problems = generate(60)
    retriever = elm.retriever
    assert retriever is not None
    keys = torch.stack([retriever.query_key(p.question) for p in problems]).numpy()
    clustered = cluster_keys(keys, threshold)
    chosen = [problems[i] for rows, _ in clustered[:pairs] for i in rows[:2]]
    in_any = {i for rows, _ in cluster_keys(keys, threshold) for i in rows}
    chosen += [p for i, p in enumerate(problems) if i not in in_any][:singles]
    if len(chosen) < 2 * pairs + singles:
        raise SystemExit(f"only {len(chosen)} questions fit --pairs {pairs} --singles {singles} at {threshold}")
    return chosen


def answers(elm: ELM, problems: list[Any], memories: list[LatentMemory | None]) -> list[str | None]:
    """Greedy answers, question i with memories[i] (None: zero-shot), in one batched call."""
    cfg = elm.config
    k = cfg.memory.num_tokens
    inputs, longest = [], 0
    for p, m in zip(problems, memories, strict=True):
        prompt = elm.prompts.answer_prompt(p.question, memory_tokens=k)
        longest = max(longest, len(prompt.token_ids))
        inputs.append(prompt.zero_shot() if m is None else prompt.with_memory(m.soft_prompt))
    budget = answer_budget(cfg.generation.max_new_tokens, elm.backend.info.max_context, longest, k)
    params = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_at_answer=cfg.generation.stop_at_answer)
    return [extract_answer(g.text) for [g] in elm.backend.generate(inputs, params)]


class Log:
    def __init__(self, path: Path):
        self.path = path
        self.rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


def grade(problem: Any, answer: str | None) -> bool:
    """Against the gold answer (text: synth-arith keeps it as an int)."""
    return bool(equivalent(answer, str(problem.answer)))


def evaluate_memory(elm: ELM, log: Log, problems: list[Any], memory_id: str, memory: Any) -> dict[str, bool]:
    """Every question of the set with ``memory`` (None: zero-shot), logged; a re-run reuses the log and
    grades the logged answers again."""
    by_id = {p.id: p for p in problems}
    done = {
        r["question_id"]: grade(by_id[r["question_id"]], r["answer"]) for r in log.rows if r["memory_id"] == memory_id
    }
    todo = [p for p in problems if p.id not in done]
    if todo:
        for p, a in zip(todo, answers(elm, todo, [memory] * len(todo)), strict=True):
            done[p.id] = grade(p, a)
            log.add(memory_id=memory_id, question_id=p.id, answer=a, correct=done[p.id])
    return done


def top1_answers(elm: ELM, log: Log, problems: list[Any], picks: dict[str, LatentMemory]) -> dict[str, bool]:
    """Each question with the memory retrieval picked for it, all in one batched call (logged, reused)."""
    graded = {
        (r["memory_id"], r["question_id"]): grade(next(p for p in problems if p.id == r["question_id"]), r["answer"])
        for r in log.rows
    }
    todo = [p for p in problems if (picks[p.id].id, p.id) not in graded]
    if todo:
        for p, a in zip(todo, answers(elm, todo, [picks[p.id] for p in todo]), strict=True):
            graded[(picks[p.id].id, p.id)] = grade(p, a)
            log.add(memory_id=picks[p.id].id, question_id=p.id, answer=a, correct=graded[(picks[p.id].id, p.id)])
    return {p.id: graded[(picks[p.id].id, p.id)] for p in problems}


def pool_summary(
    elm: ELM, log: Log, problems: list[Any], store: ChromaMemoryStore, zs: dict[str, bool], top1_only: bool
) -> dict[str, Any]:
    records = store.list(NAMESPACE)
    memories = {r.id: store.load(r) for r in records}
    retriever = elm.retriever
    assert retriever is not None
    picks: dict[str, LatentMemory] = {}
    for p in problems:
        [hit] = store.query("input", retriever.query_key(p.question), NAMESPACE, k=1)
        picks[p.id] = memories[hit.record.id]
    acc: dict[str, float] = {}
    if top1_only:
        top1 = top1_answers(elm, log, problems, picks)
    else:
        matrix = {mid: evaluate_memory(elm, log, problems, mid, m) for mid, m in memories.items()}
        top1 = {p.id: matrix[picks[p.id].id][p.id] for p in problems}
        acc = {mid: sum(row.values()) / len(problems) for mid, row in matrix.items()}
    picked = {qid: m.id for qid, m in picks.items()}
    return {
        "memories": len(memories),
        "zero_shot": sum(zs.values()) / len(problems),
        "mean_memory_accuracy": sum(acc.values()) / len(acc) if acc else None,
        "best_memory_accuracy": max(acc.values()) if acc else None,
        "top1_accuracy": sum(top1.values()) / len(problems),
        "top1_correct": top1,
        "top1_memory": picked,
        "per_memory_accuracy": acc,
        "merged": {m.id: m.meta.merged_from for m in memories.values() if m.meta.merged_from},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--singles", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.99)
    ap.add_argument("--merge-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="model.num_threads (1 on a busy 2-core box)")
    ap.add_argument(
        "--top1-only", action="store_true", help="answer each question only with the memory retrieval picks"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "merge_offline")
    args = ap.parse_args(argv)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cfg = ELMConfig.load(
        preset=args.preset,
        overrides={
            "store": {"path": str(out / "pools" / "unmerged")},
            "learner": {"mode": "off"},
            **({"model": {"num_threads": args.threads}} if args.threads else {}),
        },
    )
    elm = ELM(cfg)
    problems = pick_questions(elm, args.pairs, args.singles, args.threshold)
    print(f"{len(problems)} questions: {[p.id for p in problems]}", flush=True)
    log = Log(out / "answers.jsonl")
    zs_rows = evaluate_memory(elm, log, problems, "zero_shot", None)
    base = out / "pools" / "unmerged"
    timings_file = out / "timings.json"
    timings: dict[str, float] = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
    unmerged = ChromaMemoryStore(base, model=elm.loaded.info)
    if unmerged.count(NAMESPACE) < len(problems):
        t0 = time.perf_counter()
        elm.learn_many([p.question for p in problems], namespace=NAMESPACE, progress=False)
        timings["learn_seconds"] = round(time.perf_counter() - t0, 1)
        timings_file.write_text(json.dumps(timings))
    pools: dict[str, ChromaMemoryStore] = {"unmerged": unmerged}
    for strategy in ("average", "train"):
        root = out / "pools" / strategy
        if not root.exists():
            shutil.copytree(base, root)
            store = ChromaMemoryStore(root, model=elm.loaded.info)
            clusters = find_clusters(store, namespace=NAMESPACE, threshold=args.threshold)
            t0 = time.perf_counter()
            if strategy == "average":
                merge_clusters(store, clusters, average_memory)
            else:

                def build(members: Any) -> LatentMemory:
                    return train_merged(
                        members,
                        config=cfg,
                        loaded=elm.loaded,
                        backend=elm.backend,
                        prompts=elm.prompts,
                        steps=args.merge_steps,
                    )

                merge_clusters(store, clusters, build)
            timings[f"merge_{strategy}_seconds"] = round(time.perf_counter() - t0, 1)
            timings_file.write_text(json.dumps(timings))
        pools[strategy] = ChromaMemoryStore(root, model=elm.loaded.info)
    summary: dict[str, Any] = {
        "preset": args.preset,
        "threads": args.threads,
        "top1_only": args.top1_only,
        "S": cfg.training.steps,
        "G": cfg.training.num_generations,
        "merge_steps": args.merge_steps,
        "threshold": args.threshold,
        "questions": [{"id": p.id, "family": p.family, "question": p.question} for p in problems],
        "timings": timings,
        "pools": {},
    }
    for name, store in pools.items():
        summary["pools"][name] = pool_summary(elm, log, problems, store, zs_rows, args.top1_only)
        s = summary["pools"][name]
        print(
            f"{name}: {s['memories']} memories, zero-shot {s['zero_shot']:.3f}, mean memory "
            f"{s['mean_memory_accuracy']}, best {s['best_memory_accuracy']}, top-1 {s['top1_accuracy']:.3f}",
            flush=True,
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"done in {summary['seconds']} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
