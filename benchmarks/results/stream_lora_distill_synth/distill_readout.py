"""Reading 5 of PLAN.md, counted from records.jsonl: per half, how often each greedy answer equals
self-consistency's vote and the zero-shot samples' own vote, how often it has no boxed answer, how much the
samples agree, and what the updates did.

    python benchmarks/results/stream_lora_distill_synth/distill_readout.py RUN_DIR [--arm sft]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elm_memory.answers import equivalent
from elm_memory.answers.vote import majority_vote


def majority_share(answers: list[str | None]) -> float:
    """The largest group of equivalent answers over all of them (no answer agrees with nothing)."""
    best = 0
    for a in answers:
        if a is not None:
            best = max(best, sum(1 for b in answers if b is not None and equivalent(a, b)))
    return best / len(answers) if answers else 0.0


def readout(records: list[dict], arm: str) -> dict:
    records = sorted((r for r in records if r["method"] == "elm_stream"), key=lambda r: r["index"])
    warmup = len(records) // 2
    halves = {"warm-up": records[:warmup], "test": records[warmup:]}
    greedy_rows = ("zero_shot", f"stream_greedy[{arm}]", "format")
    out: dict = {"questions": len(records), "warmup": warmup, "halves": {}}
    for name, part in halves.items():
        n = len(part)
        rows = [r["extra"]["stream"]["rows"] for r in part]
        samples = [r["extra"]["stream"]["samples"] for r in part]
        sample_votes = [majority_vote(s["zero_shot"]).answer for s in samples]
        updates = [(r["extra"]["stream"].get("updates") or {}).get(arm) or {} for r in part]
        out["halves"][name] = {
            "questions": n,
            "equals_sc_vote": {
                g: _share(sum(bool(equivalent(x[g], x["self_consistency"])) for x in rows), n) for g in greedy_rows
            },
            # the 4 zero-shot samples' own vote (no greedy answer in it, ties to the first): zero-shot's greedy
            # answer is not favoured as it is in self-consistency's vote, which it breaks ties of
            "equals_sample_vote": {
                g: _share(sum(bool(equivalent(x[g], v)) for x, v in zip(rows, sample_votes, strict=True)), n)
                for g in greedy_rows
            },
            "no_boxed_answer": {g: _share(sum(x[g] is None for x in rows), n) for g in greedy_rows},
            "sample_majority_share": {
                "zero_shot": _mean([majority_share(s["zero_shot"]) for s in samples]),
                arm: _mean([majority_share(s[arm]) for s in samples]),
            },
            "updates_applied": sum(bool(u.get("applied")) for u in updates),
            "skipped": {
                k: sum(u.get("skipped") == k for u in updates)
                for k in sorted({u.get("skipped") for u in updates if u.get("skipped")})
            },
            "rollbacks": sum(u.get("skipped") == "rolled_back" for u in updates),
        }
    return out


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--arm", default="sft")
    args = ap.parse_args()
    records = [json.loads(line) for line in (args.run_dir / "records.jsonl").read_text().splitlines() if line]
    result = readout(records, args.arm)
    (args.run_dir / "distill_readout.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
