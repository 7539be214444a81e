"""The curves of one stream's seeds, pooled: each row's accuracy per block of questions (all seeds' answers in
that block together), the stream memory's gaps over zero-shot and self-consistency per block, and its rollbacks.
Descriptive, not a planned reading: the sign tests are `evidence_readout.py`'s.

    python benchmarks/results/stream_lora_distill_evidence/evidence_curves.py RUN [RUN ...] --out FILE.png

A RUN is a run directory or a results folder holding its ``records.jsonl``. Loads no model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from elm_memory.eval.records import RecordLog
from elm_memory.eval.report import _figure, _save
from elm_memory.eval.stream_report import graded, stream_history, stream_records, warmup_of

#: The rows drawn, in the legend's order; dashed ones are the controls the memory must beat.
ROWS = ("zero_shot", "format", "self_consistency", "stream_greedy[{arm}]", "stream_vote[{arm}]")
CONTROLS = ("zero_shot", "format", "self_consistency")


def blocks(runs: list[list[dict[str, Any]]], arm: str, size: int) -> list[dict[str, Any]]:
    """Per block of ``size`` stream positions: answers, each row's accuracy, and the rollbacks, over all runs."""
    rows = [r.format(arm=arm) for r in ROWS]
    out: dict[int, dict[str, Any]] = {}
    for records in runs:
        for g in graded(stream_records(records)):
            b = out.setdefault(g["index"] // size, {"answers": 0, "right": dict.fromkeys(rows, 0), "rollbacks": 0})
            b["answers"] += 1
            for row in rows:
                b["right"][row] += g["right"][row]
        for h in stream_history(records).get(arm, []):
            if h["skipped"] == "rolled_back":
                out[h["index"] // size]["rollbacks"] += 1
    return [
        {
            "first": k * size,
            "last": k * size + size - 1,
            "answers": b["answers"],
            "accuracy": {row: b["right"][row] / b["answers"] for row in rows},
            "rollbacks": b["rollbacks"],
        }
        for k, b in sorted(out.items())
    ]


def plot(per_block: list[dict[str, Any]], arm: str, warmups: set[int], size: int, title: str, out: Path) -> Path:
    fig = _figure(11.0, 4.5)
    left, right = fig.subplots(1, 2)
    xs = [(b["first"] + b["last"] + 1) / 2 for b in per_block]
    for template in ROWS:
        row = template.format(arm=arm)
        dashed = template in CONTROLS
        left.plot(xs, [100 * b["accuracy"][row] for b in per_block], "--" if dashed else "-", marker="o", label=row)
    greedy, vote = f"stream_greedy[{arm}]", f"stream_vote[{arm}]"
    gap_greedy = [100 * (b["accuracy"][greedy] - b["accuracy"]["zero_shot"]) for b in per_block]
    gap_vote = [100 * (b["accuracy"][vote] - b["accuracy"]["self_consistency"]) for b in per_block]
    right.plot(xs, gap_greedy, marker="o", label=f"{greedy} − zero_shot")
    right.plot(xs, gap_vote, marker="o", label=f"{vote} − self_consistency")
    right.axhline(0, color="black", linewidth=0.8)
    for x, b, y in zip(xs, per_block, gap_greedy, strict=True):
        if b["rollbacks"]:
            right.annotate(f"{b['rollbacks']}×rb", (x, y), textcoords="offset points", xytext=(0, 8), fontsize=7)
    for ax in (left, right):
        for warmup in warmups:  # one per run length: a run cut short has its own half
            ax.axvline(warmup, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel(f"stream position, blocks of {size} (dotted: end of warm-up)")
        ax.legend(fontsize=7, loc="best")
    left.set_ylabel("accuracy in the block, all seeds (%)")
    right.set_ylabel("points (rb: rollbacks in the block)")
    fig.suptitle(title)
    return _save(fig, out.parent, out.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="run directories (or results folders) of one stream")
    ap.add_argument("--arm", default="sft")
    ap.add_argument("--block", type=int, default=25, help="questions a block (default 25)")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write; its table goes beside it as .json")
    args = ap.parse_args()
    runs = [[r for r in RecordLog(p / "records.jsonl").read() if r["method"] == "elm_stream"] for p in args.runs]
    datasets = {json.loads((p / "run.json").read_text(encoding="utf-8"))["dataset"] for p in args.runs}
    if len(datasets) != 1:
        raise SystemExit(f"one stream at a time: these runs are of {sorted(datasets)}")
    warmups = {warmup_of(rs) for rs in runs}
    per_block = blocks(runs, args.arm, args.block)
    title = f"{datasets.pop()}: {len(runs)} seeds pooled, accuracy per block of {args.block}"
    plot(per_block, args.arm, warmups, args.block, title, args.out)
    table = {"runs": [p.name for p in args.runs], "arm": args.arm, "block": args.block, "warmups": sorted(warmups)}
    table["blocks"] = per_block
    args.out.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
