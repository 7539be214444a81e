"""PLAN.md's readings for the runs of one stream, counted from their records: readings 1-4 pooled over the
runs' test halves (each run's own second half; a question counted once in a sign test), reading 5 (an applied
update's time over its question's decode time), reading 6 per run (pilot 4's `distill_readout.py`), and which
of the plan's targets the pooled numbers meet.

    python benchmarks/results/stream_lora_distill_evidence/evidence_readout.py RUN [RUN ...] --out FILE.json

Loads no model. A run still going is read as far as it got.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

from elm_memory.eval.records import RecordLog
from elm_memory.eval.stream_report import summarize_stream, warmup_of

HERE = Path(__file__).resolve().parent
#: (row, baseline) of PLAN.md's readings 1-4, in its order.
READINGS = {
    1: ("stream_greedy[{arm}]", "zero_shot"),
    2: ("stream_vote[{arm}]", "self_consistency"),
    3: ("stream_zs_vote[{arm}]", "self_consistency"),
    4: ("stream_greedy[{arm}]", "format"),
}


def _distill_readout() -> Any:
    """Pilot 4's mechanism readout (reading 6), the same code that read the pilot."""
    path = HERE.parent / "stream_lora_distill_synth" / "distill_readout.py"
    spec = importlib.util.spec_from_file_location("distill_readout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.readout


def cost(records: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    """Reading 5: per question with an applied update, the update's seconds over the question's decode seconds."""
    ratios, seconds, decode = [], [], []
    for r in records:
        stream = (r.get("extra") or {}).get("stream") or {}
        update = (stream.get("updates") or {}).get(arm) or {}
        if stream.get("decode_seconds"):
            decode.append(float(stream["decode_seconds"]))
        if update.get("applied") and stream.get("decode_seconds"):
            seconds.append(float(update["seconds"]))
            ratios.append(float(update["seconds"]) / float(stream["decode_seconds"]))
    return {
        "applied_updates": len(ratios),
        "mean_update_seconds": round(statistics.fmean(seconds), 2) if seconds else None,
        "mean_decode_seconds": round(statistics.fmean(decode), 2) if decode else None,
        "mean_update_over_decode": round(statistics.fmean(ratios), 3) if ratios else None,
        # pilot 4's 0.17x was this one: the mean update over the mean decode
        "update_over_decode_of_means": round(statistics.fmean(seconds) / statistics.fmean(decode), 3)
        if seconds and decode
        else None,
    }


def readings(runs: list[list[dict[str, Any]]], arm: str) -> dict[str, Any]:
    pooled = summarize_stream(runs, warmup=[warmup_of(r) for r in runs])
    test = pooled["parts"]["test"]
    out: dict[str, Any] = {"test_answers": test["answers"], "warmups": pooled["warmup"], "readings": {}, "exact": {}}
    for number, (row_t, base) in READINGS.items():
        row = row_t.format(arm=arm)
        if row not in test["accuracy"]:
            continue
        [t] = [t for t in test["tests"] if t["row"] == row and t["baseline"] == base]
        points = 100 * (test["accuracy"][row] - test["accuracy"][base])
        out["exact"][number] = {"points": points, "p": t["p"]}  # the targets read these, not the rounded ones
        out["readings"][number] = {
            "row": row,
            "baseline": base,
            "row_accuracy": round(test["accuracy"][row], 4),
            "baseline_accuracy": round(test["accuracy"][base], 4),
            "points": round(points, 1),
            "wins": t["wins"],
            "losses": t["losses"],
            "net": t["wins"] - t["losses"],
            "p": round(t["p"], 5),
        }
    return out


def targets(pooled: dict[str, Any], costs: list[dict[str, Any]]) -> dict[str, Any]:
    """PLAN.md's targets on this stream's pooled numbers (the other stream's condition is read across files)."""
    r, exact = pooled["readings"], pooled["exact"]
    ratios = [c["mean_update_over_decode"] for c in costs if c["mean_update_over_decode"] is not None]
    return {
        "reading_1_plus_5_points_p_0.05": exact[1]["points"] >= 5 and exact[1]["p"] < 0.05,
        "reading_1_not_below_zero_shot": r[1]["net"] >= 0,
        "reading_2_plus_3_points_p_0.05": exact[2]["points"] >= 3 and exact[2]["p"] < 0.05,
        "reading_4_not_below_format": r[4]["net"] >= 0,
        "reading_5_at_most_half": bool(ratios) and max(ratios) <= 0.5,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="run directories of one stream, in the plan's seed order")
    ap.add_argument("--arm", default="sft")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    readout = _distill_readout()
    runs, per_run = [], []
    for path in args.runs:
        manifest = json.loads((path / "run.json").read_text(encoding="utf-8"))
        records = [r for r in RecordLog(path / "records.jsonl").read() if r["method"] == "elm_stream"]
        runs.append(records)
        per_run.append(
            {
                "run": path.name,
                "dataset": manifest["dataset"],
                "seed": manifest["seed"],
                "questions": len(records),
                **readings([records], args.arm),
                "cost": cost(records, args.arm),
                "mechanism": readout(records, args.arm),
            }
        )
    datasets = {r["dataset"] for r in per_run}
    if len(datasets) != 1:
        raise SystemExit(f"one stream at a time: these runs are of {sorted(datasets)}")
    pooled = readings(runs, args.arm)
    result = {
        "dataset": datasets.pop(),
        "seeds": [r["seed"] for r in per_run],
        "pooled": pooled,
        "targets_on_this_stream": targets(pooled, [r["cost"] for r in per_run]),
        "runs": per_run,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("dataset", "seeds", "pooled", "targets_on_this_stream")}, indent=2))


if __name__ == "__main__":
    main()
