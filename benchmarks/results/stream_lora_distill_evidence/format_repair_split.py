"""Not a planned reading (added after synth-arith's three seeds were in, descriptive only): how much of a row's
gain over a baseline is format repair. Per answer on each run's test half (a question in two seeds counts twice),
the row's wins split by whether the baseline had no ``\\boxed{}`` answer or a wrong one, and its losses by whether
the row had none or a wrong one; and, over every question, the rows' accuracy and unboxed share per block of 25
questions of the stream (pooled over the runs), to see when the gain appears.

    python benchmarks/results/stream_lora_distill_evidence/format_repair_split.py RUN [RUN ...] --out FILE.json

Loads no model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elm_memory.eval.records import RecordLog
from elm_memory.eval.stream_report import graded, stream_records, warmup_of

PAIRS = [
    ("stream_greedy[sft]", "zero_shot"),
    ("stream_greedy[sft]", "format"),
    ("stream_vote[sft]", "self_consistency"),
]


def split(runs: list[list[dict]], row: str, base: str) -> dict[str, int]:
    out = {"wins_baseline_unboxed": 0, "wins_baseline_wrong": 0, "losses_row_unboxed": 0, "losses_row_wrong": 0}
    for records in runs:
        warmup = warmup_of(records)
        for g in graded(stream_records(records)):
            if g["index"] < warmup or g["right"][row] == g["right"][base]:
                continue
            if g["right"][row]:
                out["wins_baseline_unboxed" if g["unboxed"][base] else "wins_baseline_wrong"] += 1
            else:
                out["losses_row_unboxed" if g["unboxed"][row] else "losses_row_wrong"] += 1
    return out


BLOCK = 25
ROWS = ["zero_shot", "stream_greedy[sft]", "self_consistency", "stream_vote[sft]"]


def by_block(runs: list[list[dict]]) -> list[dict]:
    blocks: dict[int, list[dict]] = {}
    for records in runs:
        for g in graded(stream_records(records)):
            blocks.setdefault(g["index"] // BLOCK, []).append(g)
    out = []
    for b, gs in sorted(blocks.items()):
        n = len(gs)
        out.append(
            {
                "questions": f"{b * BLOCK}-{b * BLOCK + BLOCK - 1}",
                "answers": n,
                "accuracy": {row: round(sum(g["right"][row] for g in gs) / n, 3) for row in ROWS},
                "unboxed": {row: round(sum(g["unboxed"][row] for g in gs) / n, 3) for row in ROWS[:2]},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [list(RecordLog(p / "records.jsonl").read()) for p in args.runs]
    result = {
        "runs": [p.name for p in args.runs],
        **{f"{row} vs {base}": split(runs, row, base) for row, base in PAIRS},
    }
    result["by_block"] = by_block(runs)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
