"""Calibration of the toy ``synth-arith`` stream: the default model's zero-shot accuracy, overall and
per family, from a finished ``elm stream`` run directory (no model is loaded here).

    nice -n 19 .venv/bin/elm stream --dataset synth-arith --limit 60 --seed 17 -m zero_shot \\
        --preset cpu-demo --no-plots --out /tmp/synth-cal
    .venv/bin/python -m benchmarks.synth_arith_calibration /tmp/synth-cal

Writes ``benchmarks/results/synth_arith_calibration.json``. The target band is 55-80%: high enough
that the model has signal, low enough that memories have something to fix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "synth_arith_calibration.json"


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson interval of a proportion: honest about how little n questions say."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--method", default="zero_shot")
    parser.add_argument("--command", default=None, help="the command that made the run (default: rebuilt)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from elm_memory.config import ELMConfig
    from elm_memory.environment import collect_env
    from elm_memory.eval.datasets import load_dataset
    from elm_memory.eval.synth import GENERATOR_SEED, GENERATOR_VERSION, N_PROBLEMS, vendored_path

    run = json.loads((args.run_dir / "run.json").read_text(encoding="utf-8"))
    if run["dataset"] != "synth-arith":
        raise SystemExit(f"{args.run_dir} is a {run['dataset']} run, not synth-arith")
    family = {p.id: p.family for p in load_dataset("synth-arith")}
    records = [json.loads(line) for line in (args.run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r["method"] == args.method]
    if len(records) != len(run["question_ids"]):
        raise SystemExit(f"{len(records)} {args.method} records for {len(run['question_ids'])} questions: unfinished")

    per: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        per[family[r["question_id"]]].append(bool(r["correct"]))
    k, n = sum(r["correct"] for r in records), len(records)
    config = ELMConfig.model_validate(run["config"])
    env = collect_env(config)
    command = args.command or (
        f"elm stream --dataset synth-arith --limit {n} --seed {run['seed']} -m {args.method} --preset cpu-demo "
        f"--no-plots --out {args.run_dir}"
    )
    result = {
        "what": "zero-shot greedy accuracy of the default model on the toy synth-arith stream (target band 55-80%)",
        "command": command,
        "dataset": {
            "name": "synth-arith",
            "generator_version": GENERATOR_VERSION,
            "generator_seed": GENERATOR_SEED,
            "file_rows": N_PROBLEMS,
            "file_sha256": hashlib.sha256(vendored_path().read_bytes()).hexdigest(),
        },
        "stream": {"seed": run["seed"], "questions": n},
        "model": config.model.name_or_path,
        "max_new_tokens": config.generation.max_new_tokens,
        "accuracy": round(k / n, 4),
        "correct": k,
        "questions": n,
        "wilson_95": wilson(k, n),
        "in_target_band": 0.55 <= k / n <= 0.80,
        "per_family": {
            f: {"accuracy": round(sum(v) / len(v), 3), "correct": sum(v), "questions": len(v)}
            for f, v in sorted(per.items())
        },
        "no_boxed_answer": sum(r["answer"] is None for r in records),
        "answer_seconds_per_question": round(statistics.mean(r["timings"]["answer"] for r in records), 2),
        "batched": max(r.get("batched", 1) for r in records),
        "machine": {"cpu": env.get("cpu"), "resolved": env.get("resolved"), "packages": env.get("packages")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("accuracy", "correct", "questions", "wilson_95", "per_family")}, indent=1))


if __name__ == "__main__":
    main()
