"""The main job's wall time with answering and learning side by side, against one after the other.

Runs ``elm demo`` (8 synth-arith questions, ``cpu-demo``) twice in fresh run directories, one right
after the other on the same machine: ``learner.overlap_answering=false`` (answer, then learn) and
``true`` (the default: the memory answer's decode and the first training step's rollouts share one
batch). Writes the wall times, their ratio, per-question seconds and both runs' accuracies.

    python benchmarks/demo_overlap.py --out benchmarks/results/demo_overlap.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elm_memory.config import ELMConfig
from elm_memory.environment import collect_env
from elm_memory.eval.records import RecordLog


def run_demo(out: Path, overlap: bool, limit: int) -> dict:
    cmd = [sys.executable, "-m", "elm_memory.cli", "demo", "--limit", str(limit), "--out", str(out)]
    cmd += ["--set", f"learner.overlap_answering={str(overlap).lower()}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"elm demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = RecordLog(out / "records.jsonl").read()
    elm = sorted((r for r in records if r["method"] == "elm_input"), key=lambda r: r["index"])
    zs = [r for r in records if r["method"] == "zero_shot"]
    return {
        "overlap_answering": overlap,
        "wall_seconds": round(wall, 1),  # includes loading the prepared model and writing the plots
        "elm_correct": sum(r["correct"] for r in elm),
        "zero_shot_correct": sum(r["correct"] for r in zs),
        "questions": len(elm),
        "answer_seconds": [round(r["timings"]["answer"], 1) for r in elm],
        "learn_seconds": [round(r["timings"]["learn"], 1) for r in elm],
        "routes": [r["route"] for r in elm],
        "answers": [r["answer"] for r in elm],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_demo(Path(tmp) / f"overlap-{o}", o, args.limit) for o in (False, True)]
        for r in runs:
            print(json.dumps({k: r[k] for k in ("overlap_answering", "wall_seconds", "elm_correct")}), flush=True)
    report = {
        "benchmark": "demo_overlap",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
        "sequential_over_overlapped": round(runs[0]["wall_seconds"] / runs[1]["wall_seconds"], 2),
        "environment": {
            k: v for k, v in collect_env(ELMConfig.load(preset="cpu-demo")).items() if k in ("cpu", "resolved")
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
