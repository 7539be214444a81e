"""Issue #66's quality bar: greedy accuracy of the one-row engines against the plain loop, on the path users run.

    python -m benchmarks.int4_quality --runs /tmp/int4_quality --json
    python -m benchmarks.int4_quality --runs DIR --datasets synth-arith,gsm8k --limit 60 --seed 17 --engines int4,llama

For each dataset, one ``elm stream -m zero_shot --batch-size 1`` run per engine on the same questions in the same
order (``backend.one_row_engine: plain`` and each of ``--engines``: ``int4``, ``llama``), at the ``cpu-demo``
preset's budgets (384-token answers). ``--batch-size 1`` makes every call one row, the calls the engines serve.
Each run is a run directory under ``--runs``: re-running resumes it, so the check can be spread over sessions.

Then, per dataset and engine, from the records alone: accuracy, boxed share and tokens per answer; the paired wins
and losses against plain over the same questions with the exact sign test; how many answers are token for token
the same, and for the rest where the first token differs (``generation.token_ids``). The bar is
|engine - plain| <= 2 points on each dataset. Prints one JSON object, also written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cpu_decode_pilot import _cpu_model, _git_head
from benchmarks.cpu_decode_pilot import _first_divergence as first_divergence

RESULTS = Path(__file__).parent / "results" / "answer_rows" / "int4_quality.json"
ENGINES = ("int4", "llama")  # each read against plain
BAR_POINTS = 2.0


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    from elm_memory.eval.records import RecordLog

    return RecordLog(run_dir / "records.jsonl").read()


def _token_ids(record: Mapping[str, Any]) -> list[int] | None:
    kept = (record.get("extra") or {}).get("generation") or {}
    return list(kept["token_ids"]) if "token_ids" in kept else None


def compare(
    plain: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]], engine: str = "int4"
) -> dict[str, Any]:
    """One dataset's reading of ``engine`` (its records ``other``) against plain: both engines' accuracy, boxed
    share and tokens on the questions both answered, the paired outcomes, and where the tokens first differ."""
    from elm_memory.eval.significance import sign_test

    by_id = {name: {r["question_id"]: r for r in recs} for name, recs in (("plain", plain), (engine, other))}
    shared = [q for q in by_id["plain"] if q in by_id[engine]]
    if not shared:
        return {"questions": 0}
    out: dict[str, Any] = {"questions": len(shared)}
    for name, recs in by_id.items():
        rows = [recs[q] for q in shared]
        tokens = [len(t) for t in map(_token_ids, rows) if t is not None]
        out[name] = {
            "accuracy": round(100 * sum(bool(r["correct"]) for r in rows) / len(rows), 1),
            "boxed": round(100 * sum("\\boxed" in (r.get("response") or "") for r in rows) / len(rows), 1),
            "tokens_per_answer": round(sum(tokens) / len(tokens), 1) if tokens else None,
            "rows_per_call": sorted({r.get("batched", 1) for r in rows}),
        }
    wins = sum(bool(by_id[engine][q]["correct"]) and not by_id["plain"][q]["correct"] for q in shared)
    losses = sum(bool(by_id["plain"][q]["correct"]) and not by_id[engine][q]["correct"] for q in shared)
    divergence = []
    for q in shared:
        a, b = _token_ids(by_id["plain"][q]), _token_ids(by_id[engine][q])
        divergence.append(None if a is None or b is None else first_divergence(a, b))
    differing = sorted(d for d in divergence if d is not None)
    delta = out[engine]["accuracy"] - out["plain"]["accuracy"]
    out.update(
        minus_plain_points=round(delta, 1),
        within_bar=abs(delta) <= BAR_POINTS,
        paired={"wins": wins, "losses": losses, "p": sign_test(wins, losses)},
        same_answer=sum(by_id["plain"][q]["answer"] == by_id[engine][q]["answer"] for q in shared),
        same_tokens=sum(d is None for d in divergence),
        first_divergence={
            "questions": len(differing),
            "median": differing[len(differing) // 2] if differing else None,
            "min": differing[0] if differing else None,
            "positions": differing,
        },
    )
    return out


def run_engine(dataset: str, engine: str, args: argparse.Namespace) -> Path:
    """Run (or resume) one engine's zero-shot stream; returns its run directory."""
    run_dir = args.runs / f"{dataset}_{engine}_s{args.seed}"
    cmd = [
        sys.executable, "-m", "elm_memory.cli", "stream",
        "--dataset", dataset, "--seed", str(args.seed), "--limit", str(args.limit),
        "-m", "zero_shot", "--batch-size", "1", "--preset", args.preset, "--no-plots",
        "--set", f"backend.one_row_engine={engine}", "--out", str(run_dir),
    ]  # fmt: skip
    if args.model:
        cmd += ["--set", f"model.name_or_path={args.model}"]
    if len(read_records(run_dir)) < args.limit:
        print(f"{dataset} {engine}: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return run_dir


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, required=True, help="where the run directories go (resumable)")
    ap.add_argument("--datasets", default="synth-arith,gsm8k")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--preset", default="cpu-demo", help="the budgets (cpu-demo: 384-token answers)")
    ap.add_argument("--model", default=None, help="model.name_or_path (default: the preset's, the packaged 0.5B)")
    ap.add_argument("--engines", default="int4", help=f"the engines read against plain, of {', '.join(ENGINES)}")
    ap.add_argument("--read-only", action="store_true", help="read the run directories as they are; run nothing")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on one line")
    ap.add_argument("--out", type=Path, default=RESULTS, help="also write the result here")
    return ap.parse_args()


def main() -> None:
    args = _args()
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    readings: dict[str, Any] = {}
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; of {', '.join(ENGINES)}")
    for dataset in datasets:
        dirs = {e: args.runs / f"{dataset}_{e}_s{args.seed}" for e in ("plain", *engines)}
        if not args.read_only:
            dirs = {e: run_engine(dataset, e, args) for e in dirs}
        plain = read_records(dirs["plain"])
        readings[dataset] = {e: compare(plain, read_records(dirs[e]), e) for e in engines}
    envs = {}
    for engine in engines:
        env = subprocess.run(
            [sys.executable, "-m", "elm_memory.cli", "env", "--json", "--set", f"backend.one_row_engine={engine}"],
            capture_output=True,
            text=True,
        )
        envs[engine] = json.loads(env.stdout) if env.returncode == 0 else None
    result = {
        "what": "zero-shot greedy accuracy, one row per call: each backend.one_row_engine against plain",
        "bar_points": BAR_POINTS,
        "within_bar": all(r.get("within_bar", False) for by in readings.values() for r in by.values()),
        "datasets": readings,
        "settings": {"limit": args.limit, "seed": args.seed, "preset": args.preset, "model": args.model},
        "machine": {"cpu_model": _cpu_model(), "env": envs},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git_head(),
    }
    text = json.dumps(result, indent=None if args.json else 2, default=str)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(text)


if __name__ == "__main__":
    main()
