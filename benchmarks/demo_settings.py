"""The main job's wall time and answers under a few settings, run back to back on one machine.

Each variant runs ``elm demo`` (8 synth-arith questions, ``cpu-demo``, ELM next to zero-shot) in a
fresh run directory with its own ``--set`` overrides, one after the other, so their ratios compare on
one machine in one sitting. Writes per variant: wall seconds, ELM's and zero-shot's right answers,
routes, answers, per-question answer and learn seconds, and the verifier's candidate scores.

    python -m benchmarks.demo_settings --out benchmarks/results/consistency_presample.json \\
        --variant self_certainty= \\
        --variant consistency=verifier.name=consistency,verifier.consistency_presample=false \\
        --variant consistency_presample=verifier.name=consistency,verifier.consistency_presample=true

``NAME@REV=...`` runs that variant on the code of git revision ``REV`` (checked out in a temporary
worktree put first on ``PYTHONPATH``), so a change compares against the code before it in one sitting:

    python -m benchmarks.demo_settings --out benchmarks/results/demo_ride_along.json \\
        --variant before@49b1cca= --variant after=
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elm_memory.config import ELMConfig
from elm_memory.environment import collect_env
from elm_memory.eval.records import RecordLog

REPO = Path(__file__).resolve().parents[1]  # where a revision's worktree is added from


def run_demo(out: Path, settings: list[str], limit: int, code: Path | None = None) -> dict:
    """One ``elm demo`` with ``--set`` for each of ``settings`` (on the package at ``code`` when given);
    what it answered and how long it took."""
    cmd = [sys.executable, "-m", "elm_memory.cli", "demo", "--limit", str(limit), "--out", str(out)]
    for setting in settings:
        cmd += ["--set", setting]
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    # run outside the repository: ``-m`` puts the working directory first on sys.path
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"elm demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = RecordLog(out / "records.jsonl").read()
    elm = sorted((r for r in records if r["method"] == "elm_input"), key=lambda r: r["index"])
    zs = [r for r in records if r["method"] == "zero_shot"]
    return {
        "settings": settings,
        "wall_seconds": round(wall, 1),  # includes loading the prepared model and writing the plots
        "elm_correct": sum(r["correct"] for r in elm),
        "zero_shot_correct": sum(r["correct"] for r in zs),
        "questions": len(elm),
        "answer_seconds": [round(r["timings"]["answer"], 1) for r in elm],
        "learn_seconds": [round(r["timings"]["learn"], 1) for r in elm],
        "routes": [r["route"] for r in elm],
        "answers": [r["answer"] for r in elm],
        "zero_shot_answers": [r["answer"] for r in sorted(zs, key=lambda r: r["index"])],
        "scores": [[c.get("score") for c in r.get("candidates") or []] for r in elm],
    }


def environment() -> dict:
    return {k: v for k, v in collect_env(ELMConfig.load(preset="cpu-demo")).items() if k in ("cpu", "resolved")}


def write_report(out: Path, benchmark: str, runs: dict | list, **extra: Any) -> None:
    """The benchmark's JSON (runs, ``extra`` such as ratios, the CPU and resolved settings) at ``out``;
    prints all but the runs."""
    report = {
        "benchmark": benchmark,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
        **extra,
        "environment": environment(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


def parse_variant(text: str) -> tuple[str, str | None, list[str]]:
    """``name[@rev]=key=value,key=value`` (``name=`` for the defaults): name, revision, settings."""
    head, _, settings = text.partition("=")
    name, _, rev = head.partition("@")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME[@REV]=key=value,... (NAME= for the defaults)")
    return name, rev or None, [s for s in settings.split(",") if s]


def checkout(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` at ``where`` (its package shadows the installed one)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--variant", action="append", required=True, help="NAME=key=value,... (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: checkout(rev, Path(tmp) / f"code-{rev}") for rev in {r for _, r, _ in variants if r}}
        try:
            for name, rev, settings in variants:
                runs[name] = run_demo(Path(tmp) / name, settings, args.limit, trees.get(rev) if rev else None)
                runs[name]["revision"] = rev or "working tree"
                print(json.dumps({"variant": name, **{k: runs[name][k] for k in ("wall_seconds", "elm_correct")}}))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    base = runs[variants[0][0]]["wall_seconds"]
    ratios = {name: round(r["wall_seconds"] / base, 2) for name, r in runs.items()}
    write_report(args.out, "demo_settings", runs, wall_over_first=ratios)


if __name__ == "__main__":
    main()
