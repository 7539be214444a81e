"""What would the retrieval gates have changed in a finished online run? (no model needed)

Reads an ``elm stream`` run directory and replays ELM's final answer under a grid of
``retrieval.min_majority_share`` and ``retrieval.min_similarity`` values: where the used memory
falls below a gate, the answer becomes ELM's own zero-shot candidate (route ``zero_shot``).
This is a lower bound on what the gate does online: the real gate moves on to the next-best
memory that passes (``top_k`` > 1) or answers zero-shot, and memories are still learned either way.

    python benchmarks/gate_counterfactual.py benchmarks/results/online_synth60_s17 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_elm(run_dir: Path, method: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r["method"] == method), key=lambda r: r["index"])


def candidate_correct(record: dict, kind: str) -> bool | None:
    for c in record.get("candidates", []):
        if c["kind"] == kind:
            return c.get("correct")
    return None


def replay(records: list[dict], min_share: float, min_sim: float | None) -> dict:
    correct = gains = losses = gated = 0
    for r in records:
        zs = bool(candidate_correct(r, "zero_shot"))
        gate = (r.get("extra") or {}).get("gate") or {}
        used = r.get("memory_id") is not None and r.get("route") != "zero_shot"
        share = gate.get("majority_share")
        sim = r.get("similarity")
        blocked = used and (
            (share is not None and share < min_share) or (min_sim is not None and sim is not None and sim < min_sim)
        )
        final = zs if blocked else bool(r["correct"])
        gated += blocked
        correct += final
        gains += final and not zs
        losses += zs and not final
    n = len(records)
    return {
        "min_majority_share": min_share,
        "min_similarity": min_sim,
        "accuracy": round(100 * correct / n, 1) if n else None,
        "correct": correct,
        "n": n,
        "gains": gains,
        "losses": losses,
        "gated": gated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--method", default="elm_input")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = {}
    for run_dir in args.run_dirs:
        records = load_elm(run_dir, args.method)
        sims = sorted(r["similarity"] for r in records if r.get("similarity") is not None)
        quantiles = [None] + [round(sims[int(q * (len(sims) - 1))], 4) for q in (0.25, 0.5, 0.75)] if sims else [None]
        grid = [replay(records, share, sim) for share in (0.0, 0.5, 0.75, 1.0) for sim in quantiles]
        report[str(run_dir)] = grid
        print(f"{run_dir} ({args.method}, {len(records)} questions)")
        print("  min_share  min_sim   acc%  gains/losses  gated")
        for g in grid:
            sim = "-" if g["min_similarity"] is None else f"{g['min_similarity']:.3f}"
            print(
                f"  {g['min_majority_share']:9.2f}  {sim:>7}  {g['accuracy']:5.1f}  "
                f"+{g['gains']}/-{g['losses']:<8}  {g['gated']}"
            )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
