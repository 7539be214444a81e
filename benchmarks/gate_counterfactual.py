"""What would the retrieval gates have changed in a finished online run? (no model needed)

Reads an ``elm stream`` run directory and replays ELM's final answer under a grid of
``retrieval.min_majority_share`` and ``retrieval.min_similarity`` values, and of
``retrieval.min_utility`` (counters rebuilt from the run's own routes, question by question): where the used memory
falls below a gate, the answer becomes ELM's own zero-shot candidate (route ``zero_shot``).
This is a lower bound on what the gate does online: the real gate moves on to the next-best
memory that passes (``top_k`` > 1) or answers zero-shot, and memories are still learned either way.

    python -m benchmarks.gate_counterfactual benchmarks/results/online_synth60_s17 [--out FILE]
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
    outcomes = []
    for r in records:
        zs = bool(candidate_correct(r, "zero_shot"))
        gate = (r.get("extra") or {}).get("gate") or {}
        used = r.get("memory_id") is not None and r.get("route") != "zero_shot"
        share = gate.get("majority_share")
        sim = r.get("similarity")
        blocked = used and (
            (share is not None and share < min_share) or (min_sim is not None and sim is not None and sim < min_sim)
        )
        outcomes.append((zs, blocked, zs if blocked else bool(r["correct"])))
    return {"min_majority_share": min_share, "min_similarity": min_sim, **tally(outcomes)}


def tally(outcomes: list[tuple[bool, bool, bool]]) -> dict:
    """(zero-shot right, gated, final right) per question -> accuracy, gains and losses against zero-shot."""
    n = len(outcomes)
    correct = sum(final for _, _, final in outcomes)
    return {
        "accuracy": round(100 * correct / n, 1) if n else None,
        "correct": correct,
        "n": n,
        "gains": sum(final and not zs for zs, _, final in outcomes),
        "losses": sum(zs and not final for zs, _, final in outcomes),
        "gated": sum(blocked for _, blocked, _ in outcomes),
    }


def outcome(record: dict) -> str | None:
    """The utility counter the graph's respond node recorded for the used memory (None: not judged)."""
    route = record.get("route")
    if route == "agree":
        return "agree"
    mem = next((c for c in record.get("candidates", []) if c["kind"] == "memory"), None)
    if mem is None or route not in ("verifier", "answered"):
        return None
    return "won" if mem.get("answer") == record.get("answer") and route != "zero_shot" else "lost"


def replay_utility(records: list[dict], min_utility: float, observations: int) -> dict:
    """``retrieval.min_utility``: a memory whose counters so far say (won + agreed) / judged < ``min_utility``
    after ``observations`` judgements is not used (the answer becomes the zero-shot candidate; a gated
    memory records nothing more, as online)."""
    counts: dict[str, list[int]] = {}  # memory id -> [won + agreed, judged]
    outcomes = []
    for r in records:
        zs = bool(candidate_correct(r, "zero_shot"))
        mid = r.get("memory_id") if r.get("route") != "zero_shot" else None
        good, judged = counts.get(mid, [0, 0]) if mid else (0, 0)
        blocked = bool(mid) and judged >= observations and good / judged < min_utility
        final = zs if blocked else bool(r["correct"])
        if mid and not blocked:
            o = outcome(r)
            if o is not None:
                c = counts.setdefault(mid, [0, 0])
                c[0] += o in ("agree", "won")
                c[1] += 1
        outcomes.append((zs, blocked, final))
    return {"min_utility": min_utility, "min_utility_observations": observations, **tally(outcomes)}


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
        utility = [replay_utility(records, u, obs) for u in (0.5,) for obs in (1, 2, 3, 5)]
        report[f"{run_dir}:min_utility"] = utility
        reuse: dict[str, int] = {}
        for r in records:
            if r.get("memory_id") and r.get("route") != "zero_shot":
                reuse[r["memory_id"]] = reuse.get(r["memory_id"], 0) + 1
        print(f"  memories used: {len(reuse)}, used more than once: {sum(v > 1 for v in reuse.values())}")
        print("  min_utility  observations   acc%  gains/losses  gated")
        for g in utility:
            print(
                f"  {g['min_utility']:11.2f}  {g['min_utility_observations']:12d}  {g['accuracy']:5.1f}  "
                f"+{g['gains']}/-{g['losses']:<8}  {g['gated']}"
            )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
