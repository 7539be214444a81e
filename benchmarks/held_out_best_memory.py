"""Is an offline study's best memory a good memory, or the luckiest of many? Reads finished runs' files.

The offline protocol evaluates every memory on every question and reports the best memory's accuracy
(the paper's Table 1). The best of N noisy memories beats zero-shot by chance alone. This picks the best
memory on a random half of the questions and scores it on the other half against zero-shot there,
averaged over 1,000 seeded splits (``elm_memory.eval.metrics.held_out_best_memory``, as ``elm offline``
reports it). Loads no model.

    python -m benchmarks.held_out_best_memory benchmarks/results/offline_synth20_s17 \
        benchmarks/results/sweep_gsm8k_q15/init benchmarks/results/sweep_gsm8k_q15/S4-G8-lr0.003-cap384-min_share0.5 \
        --out benchmarks/results/held_out_best_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elm_memory.eval.metrics import HELD_OUT_SPLITS, summarize_offline
from elm_memory.eval.offline import read_correctness


def measure(run: Path) -> dict[str, object]:
    summary = summarize_offline(*read_correctness(run))
    best = summary["best_memory"]
    return {
        "run": str(run),
        "questions": summary["n_questions"],
        "memories": summary["n_memories"],
        "zero_shot_accuracy": summary["zero_shot_accuracy"],
        "best_memory_accuracy": None if best is None else best["accuracy"],
        "mean_memory_accuracy": summary["mean_memory_accuracy"],
        "held_out": summary["best_memory_held_out"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "runs", nargs="+", type=Path, help="offline run folders (zero_shot.jsonl, evals.jsonl, memories.jsonl)"
    )
    ap.add_argument("--out", type=Path, help="also write the rows here (.json)")
    args = ap.parse_args()
    for run in args.runs:
        if not (run / "evals.jsonl").is_file():
            ap.error(f"{run}: no evals.jsonl (not an offline run folder)")
    rows = [measure(run) for run in args.runs]
    print(
        "| run | questions x memories | zero-shot | best memory | mean memory | best, held out (points vs zero-shot) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        h = r["held_out"]
        held = "n/a"
        if isinstance(h, dict):
            better, worse = 100 * h["share_better"], 100 * h["share_worse"]
            held = f"{100 * h['mean_gain']:+.1f} (better {better:.0f}%, worse {worse:.0f}%)"
        pct = lambda x: "n/a" if x is None else f"{100 * float(x):.1f}%"  # noqa: E731
        print(
            f"| {r['run']} | {r['questions']} x {r['memories']} | {pct(r['zero_shot_accuracy'])} | "
            f"{pct(r['best_memory_accuracy'])} | {pct(r['mean_memory_accuracy'])} | {held} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"benchmark": "held_out_best_memory", "splits": HELD_OUT_SPLITS, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
