"""Issue #65: what reading the gate on only a share of warm-up questions (``stream.tuning.gate_read_share``) would
do, replayed on a finished ``elm_amortized`` run's records (no decode).

In warm-up every question draws the memory's greedy answer beside the vote, only for the gate: on the first pilot that
row was 16.6% of ELM amortized's tokens, against #65's 10% target. Drawing it on a share of questions (picked by a
hash of the question, as probes are) costs proportionally less and gives the gate proportionally fewer readings. This
replays the recorded readings through the library's own gate (``AmortizationGate``) for each share and several hash
salts, and prints where the gate opens and the gate row's share of the tokens.

    python -m benchmarks.gate_share_replay benchmarks/results/amortized_pilot/synth-arith_71 --test non_inferiority
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elm_memory.graph.stream_turn import is_probe
from elm_memory.training.stream_gate import AmortizationGate, GateReading


def replay(records: list[dict], share: float, salt: int, test: str, tolerance: float) -> dict:
    """Where the gate opens (1-based question, None: never) and the gate row's share of the tokens, when only
    ``share`` of the questions draw the memory's row. Warm-up only: the questions after an opening are read as
    they were, the question here is how soon it opens."""
    gate = AmortizationGate(test=test, tolerance=tolerance)
    opened, gate_tokens, total = None, 0, 0
    peak, peak_at = gate.open_stat, None
    for i, r in enumerate(records):
        extra = r["extra"]["amortized"]
        rows, tokens = extra["rows"], extra["tokens"]
        total += tokens["self_consistency"]
        if not is_probe(r["question"], salt, share):  # picked as the turn picks them, the salt as the seed
            continue
        gate_tokens += tokens["stream_greedy"]
        total += tokens["stream_greedy"]
        reading = GateReading.of(rows["stream_greedy"], rows["zero_shot"], extra["samples"])
        if gate.observe(reading, 0) is not None and opened is None:
            opened = i + 1
        if opened is None and gate.open_stat > peak:
            peak, peak_at = gate.open_stat, i + 1
    return {
        "opened_at": opened,
        "gate_token_share": round(gate_tokens / total, 4),
        "peak_statistic": round(peak, 4),  # before any opening: how near it came (it opens at log(1 / alpha))
        "peak_at": peak_at,
        "threshold": round(gate.threshold, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an elm_amortized run directory (records.jsonl)")
    ap.add_argument("--shares", default="1.0,0.6,0.5,0.3")
    ap.add_argument("--salts", type=int, default=20, help="hash salts per share below 1")
    ap.add_argument("--test", default="non_inferiority", choices=["superiority", "non_inferiority", "sample_share"])
    ap.add_argument("--tolerance", type=float, default=0.05)
    args = ap.parse_args()
    lines = (args.run / "records.jsonl").read_text().splitlines()
    records = sorted((r for r in map(json.loads, lines) if r["method"] == "elm_amortized"), key=lambda r: r["index"])
    out = {
        "run": str(args.run),
        "questions": len(records),
        "test": args.test,
        "tolerance": args.tolerance,
        "shares": {},
    }
    for share in (float(s) for s in args.shares.split(",")):
        runs = [
            replay(records, share, salt, args.test, args.tolerance) for salt in range(1 if share >= 1 else args.salts)
        ]
        opened = [r["opened_at"] for r in runs]
        out["shares"][str(share)] = {
            "opened_at": opened,
            "opened": sum(o is not None for o in opened),
            "salts": len(runs),
            "gate_token_share": round(sum(r["gate_token_share"] for r in runs) / len(runs), 4),
            **({k: runs[0][k] for k in ("peak_statistic", "peak_at", "threshold")} if len(runs) == 1 else {}),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
