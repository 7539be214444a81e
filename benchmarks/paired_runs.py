"""Issue #65: two ``elm_amortized`` runs on the same questions (two models, say), row by row (no decode).

For each row (zero-shot, self-consistency, the memory's greedy answer), over the questions both runs answered (the
first ``--first`` of them, in run A's order): how many each run got right, the paired counts (right in B and wrong in
A, against the converse) with the exact sign test, and tokens per question. Also the seconds of answering and of
learning per question each run recorded, which is what a longer run of either would cost on the same machine.

    python -m benchmarks.paired_runs RUN_A RUN_B --first 30 --json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elm_memory.errors import ConfigError
from elm_memory.eval.amortized_report import amortized_records, mean_row_tokens, row_right
from elm_memory.eval.records import RecordLog
from elm_memory.eval.significance import sign_test

ROWS = ("zero_shot", "self_consistency", "stream_greedy")


def _records(run: str | Path) -> list[Mapping[str, Any]]:
    path = Path(run) / "records.jsonl"
    if not path.is_file():
        raise ConfigError(f"no records.jsonl in {run}")
    mine = amortized_records(RecordLog(path).read())
    if not mine:
        raise ConfigError(f"{run}: no elm_amortized records")
    return mine


def paired_runs(run_a: str | Path, run_b: str | Path, *, first: int | None = None) -> dict[str, Any]:
    """Row by row, run B against run A on the questions both answered (run A's order, cut to ``first``)."""
    a, b = _records(run_a), _records(run_b)
    by_id = {r["question_id"]: r for r in b}
    shared = [r["question_id"] for r in a if r["question_id"] in by_id][:first]
    if not shared:
        raise ConfigError(f"{run_a} and {run_b} share no question")
    in_a = {r["question_id"]: r for r in a}
    pairs = [(in_a[q], by_id[q]) for q in shared]
    rows = {}
    for row in ROWS:
        right_a = [row_right(x, row) for x, _ in pairs]
        right_b = [row_right(y, row) for _, y in pairs]
        wins = sum(rb > ra for ra, rb in zip(right_a, right_b, strict=True))
        losses = sum(rb < ra for ra, rb in zip(right_a, right_b, strict=True))
        rows[row] = {
            "right_a": int(sum(right_a)),
            "right_b": int(sum(right_b)),
            "b_only": wins,
            "a_only": losses,
            "p": sign_test(wins, losses),
            "tokens_a": mean_row_tokens([x for x, _ in pairs], row),
            "tokens_b": mean_row_tokens([y for _, y in pairs], row),
        }
    return {
        "run_a": str(run_a),
        "run_b": str(run_b),
        "questions": len(pairs),
        "rows": rows,
        "seconds_a": _seconds([x for x, _ in pairs]),
        "seconds_b": _seconds([y for _, y in pairs]),
    }


def _seconds(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean seconds a question of answering and of learning, as the run recorded them."""
    n = len(records)
    return {
        part: sum(float((r.get("timings") or {}).get(part) or 0.0) for r in records) / n for part in ("answer", "learn")
    }


def markdown(result: Mapping[str, Any]) -> str:
    n = result["questions"]
    lines = [
        f"{n} shared questions; A = `{result['run_a']}`, B = `{result['run_b']}`",
        "",
        "| row | right in A | right in B | B only / A only | sign test p | tokens A | tokens B |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, r in result["rows"].items():
        tokens = [f"{t:.0f}" if t is not None else "-" for t in (r["tokens_a"], r["tokens_b"])]
        lines.append(
            f"| {row} | {r['right_a']} ({r['right_a'] / n:.1%}) | {r['right_b']} ({r['right_b'] / n:.1%}) | "
            f"{r['b_only']} / {r['a_only']} | {r['p']:.3g} | {tokens[0]} | {tokens[1]} |"
        )
    sa, sb = result["seconds_a"], result["seconds_b"]
    lines += ["", f"seconds a question, answering + learning: A {sa['answer']:.1f} + {sa['learn']:.1f}, "
              f"B {sb['answer']:.1f} + {sb['learn']:.1f}"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paired_runs", description=__doc__.split("\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--first", type=int, default=None, help="Only the first N shared questions (A's order).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    args = parser.parse_args(argv)
    try:
        result = paired_runs(args.run_a, args.run_b, first=args.first)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(json.dumps(result, indent=2) if args.json else markdown(result))


if __name__ == "__main__":
    main()
