"""The main job's wall time with answering and learning side by side, against one after the other.

Runs ``elm demo`` (8 synth-arith questions, ``cpu-demo``) twice in fresh run directories, one right
after the other on the same machine: ``learner.overlap_answering=false`` (answer, then learn) and
``true`` (the default: the memory answer's decode and the first training step's rollouts share one
batch). Writes the wall times, their ratio, per-question seconds and both runs' accuracies.

    python -m benchmarks.demo_overlap --out benchmarks/results/demo_overlap.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.demo_settings import run_demo, write_report


def run_overlap(out: Path, overlap: bool, limit: int) -> dict:
    run = run_demo(out, [f"learner.overlap_answering={str(overlap).lower()}"], limit)
    return {"overlap_answering": overlap, **{k: v for k, v in run.items() if k not in ("settings", "scores")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_overlap(Path(tmp) / f"overlap-{o}", o, args.limit) for o in (False, True)]
        for r in runs:
            print(json.dumps({k: r[k] for k in ("overlap_answering", "wall_seconds", "elm_correct")}), flush=True)
    ratio = round(runs[0]["wall_seconds"] / runs[1]["wall_seconds"], 2)
    write_report(args.out, "demo_overlap", runs, sequential_over_overlapped=ratio)


if __name__ == "__main__":
    main()
