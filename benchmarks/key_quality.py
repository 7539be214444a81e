"""Benchmark: do the retrieval keys find related memories? Input keys against KV keys, no training.

Each of the first N questions of a stream (seeded order, as ``elm stream`` runs it) retrieves the
best of the memories of the questions before it, as the online protocol does. A memory is stood in
for by its *initial* soft prompt (the question's own token embeddings; with ``cpu-demo``'s S=1 a
trained memory is close to it), so the whole comparison needs only forward passes. Per key kind:

- ``same family``: on synth-arith, how often the retrieved memory's question has the query's
  template family (what retrieval is for; chance is about 1 in 8);
- ``distinct``: how many different memories were retrieved, and the most retrieved one's share
  (a "hub" that every query retrieves makes retrieval meaningless);
- the range of the scores.

``kv_centered`` is the library's key of that name (``retrieval.key: kv_centered``): the KV keys with
each side's per-layer mean removed before the per-layer cosine, the means taken over 64 questions of
the packaged MATH500 (none of the evaluated ones). Before it was an option this benchmark computed
the same thing itself, as ``kv centered (diagnostic)``.

    .venv/bin/python -m benchmarks.key_quality --out benchmarks/results/key_quality.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elm_memory.config import ELMConfig
from elm_memory.environment import collect_env
from elm_memory.eval.datasets import Problem, load_problems
from elm_memory.models.loading import load_model
from elm_memory.retrieval.keys import (
    CENTERING_DATASET,
    CENTERING_QUESTIONS,
    InputKeyBuilder,
    KVCenteredKeyBuilder,
    KVKeyBuilder,
)
from elm_memory.retrieval.retriever import tokenize_question
from elm_memory.training.initialization import question_init


def _kv_sides(loaded: Any, problems: list[Problem], k: int, kv: KVKeyBuilder) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, layers, head_dim) query keys of the questions and memory keys of their initial soft prompts."""
    info = loaded.info
    ids = [tokenize_question(loaded.tokenizer, p.question) for p in problems]
    queries = torch.stack([kv.query_key(loaded, q) for q in ids])
    memories = kv.memory_keys(loaded, [question_init(loaded, p.question, k, "question", 0) for p in problems])
    shape = (-1, info.num_layers, info.head_dim)
    return queries.view(shape), memories.view(shape)


def _layer_cosine(queries: torch.Tensor, memories: torch.Tensor) -> torch.Tensor:
    """The paper's KV score for every (query, memory) pair: mean over layers of the per-layer cosine."""
    q, m = F.normalize(queries, dim=-1).flatten(1), F.normalize(memories, dim=-1).flatten(1)
    return q @ m.T / queries.shape[1]


def _retrieval(scores: torch.Tensor, problems: list[Problem]) -> dict[str, Any]:
    picks = [(i, int(scores[i, :i].argmax())) for i in range(1, len(problems))]
    counts = collections.Counter(j for _, j in picks)
    out: dict[str, Any] = {
        "queries": len(picks),
        "distinct_memories_retrieved": len(counts),
        "most_retrieved_share": round(counts.most_common(1)[0][1] / len(picks), 3),
        "score_min": round(float(scores.min()), 4),
        "score_max": round(float(scores.max()), 4),
    }
    if problems[0].family is not None:
        out["same_family"] = sum(problems[i].family == problems[j].family for i, j in picks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="synth-arith,gsm8k")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "key_quality.json")
    args = ap.parse_args()
    cfg = ELMConfig.load(preset="cpu-demo")
    loaded = load_model(cfg.model)
    k = cfg.memory.num_tokens
    t0 = time.perf_counter()
    centred = KVCenteredKeyBuilder()
    centred.centres(loaded)  # the calibration, once, inside the timing
    results = []
    for name in args.datasets.split(","):
        problems = load_problems(name, limit=args.limit, seed=args.seed)
        inputs = torch.stack(
            [InputKeyBuilder().query_key(loaded, tokenize_question(loaded.tokenizer, p.question)) for p in problems]
        )
        queries, memories = _kv_sides(loaded, problems, k, KVKeyBuilder())
        c_queries, c_memories = _kv_sides(loaded, problems, k, centred)
        kinds = {
            "input": F.normalize(inputs, dim=-1) @ F.normalize(inputs, dim=-1).T,
            "kv": _layer_cosine(queries, memories),
            "kv_centered": _layer_cosine(c_queries, c_memories),
        }
        for kind, scores in kinds.items():
            row = {"dataset": name, "key": kind, **_retrieval(scores, problems)}
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {
        "benchmark": "key_quality",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "questions_per_dataset": args.limit,
        "seed": args.seed,
        "calibration": f"kv_centered: {CENTERING_DATASET}, first {CENTERING_QUESTIONS} (seed 0 order)",
        "memory_stand_in": f"initial soft prompt (memory.init question, k={k}), no training",
        "seconds": round(time.perf_counter() - t0, 1),
        "results": results,
        "environment": {k: v for k, v in collect_env(cfg).items() if k in ("cpu", "resolved")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
