"""Is a question's own training vote a good judge? Replay finished online runs with it as the router.

While ELM answers a question it also learns that question's memory: the first GRPO step samples G
rollouts and their majority answer is the TTRL reward's target (``stats.majority_answer`` of the
stored memory). Those rollouts are free test-time compute, so they could route: on a disagreement,
take the candidate the training vote agrees with. This replay asks whether that would pay, with no
model at all: for each ``elm stream`` run whose pool is kept (``<run>/store``) it reads every
question's own memory, then

- scores the training vote against the gold, next to the run's zero-shot candidate;
- routes each verifier-decided disagreement to the candidate equal to the vote (when exactly one
  is), keeping the run's choice otherwise; every other route keeps the run's outcome.

    python -m benchmarks.training_vote_replay benchmarks/results/online_synth60_s{42,78} \\
        --out benchmarks/results/training_vote_replay_synth60.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.records import RecordLog
from elm_memory.store import ChromaMemoryStore


def _votes(store_dir: Path, namespace: str) -> dict[str, dict[str, Any]]:
    """memory id -> its training stats. Read from a copy: opening a Chroma store rewrites its files,
    and the results' stores are kept as they were."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(store_dir, Path(tmp) / "store"))
        store = ChromaMemoryStore(copy)
        return {r.id: dict(r.stats or {}) for r in store.list(namespace)}


def replay_run(run_dir: Path, method: str) -> dict[str, Any]:
    records = RecordLog(run_dir / "records.jsonl").read()
    rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["index"])
    zero_row = {r["question_id"]: r["correct"] for r in records if r["method"] == "zero_shot"}
    votes = _votes(run_dir / "store", method)
    vote_right = vote_missing = decided = changed = 0
    as_run = replayed = gains = losses = 0
    for r in rows:
        job = (r.get("extra") or {}).get("learn_job") or {}
        vote = votes.get(job.get("memory_id") or "", {}).get("majority_answer")
        if vote is None:
            vote_missing += 1
        elif equivalent(vote, r["gold"]):
            vote_right += 1
        cands = {c["kind"]: c for c in r["candidates"]}
        ok = bool(r["correct"])
        if r["route"] == "verifier" and vote is not None:
            agree = [k for k, c in cands.items() if c.get("answer") is not None and equivalent(c["answer"], vote)]
            if len(agree) == 1:
                decided += 1
                new = bool(cands[agree[0]]["correct"])
                changed += new != ok
                ok = new
        as_run += bool(r["correct"])
        replayed += ok
        zero = bool(cands["zero_shot"]["correct"])
        gains += ok and not zero
        losses += zero and not ok
    n = len(rows)
    pct = lambda k: round(100.0 * k / n, 1)  # noqa: E731
    return {
        "run": str(run_dir),
        "method": method,
        "questions": n,
        "training_vote_right": vote_right,
        "training_vote_missing": vote_missing,
        "zero_shot_candidate_right": sum(bool(r["candidates"][0]["correct"]) for r in rows),
        "zero_shot_row_accuracy": round(100.0 * sum(zero_row.values()) / len(zero_row), 1) if zero_row else None,
        "verifier_routed": sum(r["route"] == "verifier" for r in rows),
        "decided_by_vote": decided,
        "outcomes_changed": changed,
        "accuracy_as_run": pct(as_run),
        "accuracy_vote_routed": pct(replayed),
        "vote_routed_gains_losses": [gains, losses],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="elm stream run directories with their store/")
    ap.add_argument("--method", default="elm_input")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    results = [replay_run(run, args.method) for run in args.runs]
    for r in results:
        print(
            f"{r['run']}: training vote right {r['training_vote_right']}/{r['questions']} "
            f"(zero-shot candidate {r['zero_shot_candidate_right']}), accuracy {r['accuracy_as_run']}% as run -> "
            f"{r['accuracy_vote_routed']}% vote-routed (zero_shot row {r['zero_shot_row_accuracy']}%)"
        )
    report = {
        "benchmark": "training_vote_replay",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": results,
        "environment": "none: no model runs; the numbers come from the runs' records and pools",
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
