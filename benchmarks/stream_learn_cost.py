"""Benchmark: what learning adds to the answer path with a stream memory (#52's target: at most 0.5x).

Runs ELM with ``stream.mode=stream`` through its graph on a few synth-arith questions, one at a time, and reads
from each answer its answer-path time (``timings.total``: retrieve, dual_generate, route, verify) and the stream
memory's update time (``stream_update.seconds``: the guard, one backward over the memory's generations, the
version write). Both are measured in the same process on the same questions, so their ratio is this machine's.

    .venv/bin/python -m benchmarks.stream_learn_cost                 # default model, 8 questions, sft
    .venv/bin/python -m benchmarks.stream_learn_cost --quick         # SmolLM2, 3 questions (plumbing)
    .venv/bin/python -m benchmarks.stream_learn_cost --kind lora     # a LoRA stream memory

Writes ``benchmarks/results/stream_learn_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "stream_learn_cost.json"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--n", type=int, default=8, help="questions (synth-arith, seed 5: not a pilot's questions)")
    parser.add_argument("--objective", default="sft", choices=["sft", "grpo"])
    parser.add_argument("--kind", default="soft_prompt", choices=["soft_prompt", "lora"], help="stream.kind")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 (cpu-tiny), 3 questions: plumbing only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> dict[str, Any]:
    from elm_memory import ELM, ELMConfig
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.records import machine_facts

    args = _args()
    preset = "cpu-tiny" if args.quick else args.preset
    n = 3 if args.quick else args.n
    with tempfile.TemporaryDirectory() as store:
        cfg = ELMConfig.load(
            preset=preset,
            overrides={
                "store": {"path": store},
                "learner": {"mode": "off"},
                "verifier": {"name": "consistency", "route": "vote"},
                "stream": {"mode": "stream", "objective": args.objective, "kind": args.kind},
            },
        )
        rows = []
        with ELM(cfg) as elm:
            for p in load_problems("synth-arith", limit=n, seed=5):
                result = elm.answer(p.question)
                update = result.stream_update or {}
                rows.append(
                    {
                        "question_id": p.id,
                        "answer_s": round(result.timings.get("total", 0.0), 3),
                        "learn_s": update.get("seconds"),
                        "applied": update.get("applied"),
                        "skipped": update.get("skipped"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        learned = [r for r in rows if r["applied"]]
        out = {
            "preset": preset,
            "objective": args.objective,
            "kind": args.kind,
            "machine": machine_facts(cfg),
            "questions": rows,
            "mean_answer_s": statistics.fmean(r["answer_s"] for r in rows),
            "mean_learn_s": statistics.fmean(r["learn_s"] or 0.0 for r in rows),
            "mean_learn_s_when_applied": statistics.fmean(r["learn_s"] for r in learned) if learned else None,
        }
        out["ratio_learn_to_answer"] = out["mean_learn_s"] / out["mean_answer_s"]
        if out["mean_learn_s_when_applied"] is not None:
            out["ratio_applied_learn_to_answer"] = out["mean_learn_s_when_applied"] / out["mean_answer_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in out.items() if k not in ("questions", "machine")}, indent=2))
    return out


if __name__ == "__main__":
    main()
