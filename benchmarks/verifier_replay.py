"""Would another verifier have routed a finished online run better? Replay its recorded disagreements.

For every question of an ``elm stream`` run that ELM's verifier decided (route ``verifier``: both
candidates answered, the answers differ), this scores the *recorded* pair of final answers
(zero-shot candidate, memory candidate) with an answer-only verifier (``consistency``: fresh
seeded zero-shot samples, each answer scores the share of samples that agree with it) and routes
it with the graph's rule (memory only on a strictly higher score). Every other question keeps the
run's outcome: agreeing answers, the ``answered`` route and gated-out memories do not depend on the
verifier, nor do retrieval and learning (a memory is learned from its question, never from the
answer), so the result is exactly what an online run with that verifier would have answered,
up to bf16 batch effects in the samples.

Only disagreements where one candidate is right can change the accuracy, so only those are
sampled; the count of the others (both wrong) is reported. Unlike ``route_replay.py`` nothing is
regenerated, so the memories' candidates are the run's own; self-certainty and logprob need the
responses' text, which a run does not record, and are replayed by ``route_replay.py`` instead.

    python -m benchmarks.verifier_replay benchmarks/results/online_synth60_s{17,42,78} \\
        --out benchmarks/results/verifier_replay_synth60.json

``--tie-samples N`` replays ``verifier.consistency_tie_samples`` on runs that already routed with
``consistency``: the recorded scores are the first draw (score x samples agreeing samples), and only
where they tie are N more samples drawn (the verifier's own tie call: seed + 1) and counted with them.
That is the online escalation on the run's own first samples, so nothing but the ties is redrawn.

    python -m benchmarks.verifier_replay benchmarks/results/online_synth60_cons_s{17,42,78} \\
        --tie-samples 8 --out benchmarks/results/tie_replay_synth60_cons.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.environment import collect_env
from elm_memory.eval.records import RecordLog
from elm_memory.verifiers import build_verifier


def _elm_records(run_dir: Path, method: str) -> list[dict[str, Any]]:
    rows = RecordLog(run_dir / "records.jsonl").read()
    return sorted((r for r in rows if r["method"] == method), key=lambda r: r["index"])


def _candidate(record: dict[str, Any], kind: str) -> str | None:
    return next((c["answer"] for c in record["candidates"] if c["kind"] == kind), None)


def _scores(
    verifier: Any, record: dict[str, Any], answers: list[str | None], run_samples: int | None, tie_samples: int
) -> list[float]:
    """Fresh samples (``run_samples`` None), or the run's recorded scores as the first draw plus the tie call."""
    if run_samples is None:
        return list(verifier.score_answers(record["question"], answers))
    recorded = [float(c["score"]) for c in record["candidates"]]
    if not verifier.is_tie(answers, recorded):
        return recorded
    more = verifier.sample_answers(record["question"], n=tie_samples, seed_offset=1)
    agree = [
        round(s * run_samples) + sum(equivalent(a, m) for m in more) if a is not None else 0
        for a, s in zip(answers, recorded, strict=True)
    ]
    return [a / (run_samples + len(more)) for a in agree]


def replay_run(
    run_dir: Path, method: str, verifier_name: str, elm: ELM | None, limit: int | None = None, tie_samples: int = 0
) -> tuple[dict[str, Any], ELM]:
    run = json.loads((run_dir / "run.json").read_text())
    cfg = ELMConfig.model_validate(run["config"])
    run_samples = None  # draw every disagreement's samples afresh
    if tie_samples:
        if cfg.verifier.name != "consistency":
            raise SystemExit(f"{run_dir}: --tie-samples replays runs that routed with consistency")
        run_samples = cfg.verifier.consistency_samples
    cfg = cfg.model_copy(
        update={
            "store": cfg.store.model_copy(update={"kind": "none"}),
            "learner": cfg.learner.model_copy(update={"mode": "off"}),
            "verifier": cfg.verifier.model_copy(update={"name": verifier_name}),
        }
    )
    if elm is None:  # one model for all runs (they share it; the check below refuses a mix)
        elm = ELM(cfg)
    elif elm.config.model != cfg.model:
        raise SystemExit(f"{run_dir}: another model than the first run's; replay such runs separately")
    verifier = build_verifier(cfg, elm.backend)
    records = _elm_records(run_dir, method)[:limit]
    t0 = time.perf_counter()
    run_correct = replay_correct = zs_correct = 0
    run_gains = run_losses = gains = losses = 0
    decided = one_right = both_wrong = run_right_pick = replay_right_pick = 0
    changed: list[dict[str, Any]] = []
    for r in records:
        gold, ok = r["gold"], bool(r["correct"])
        zs, mem = _candidate(r, "zero_shot"), _candidate(r, "memory")
        z_ok = bool(zs is not None and equivalent(zs, gold))
        new_ok = ok
        if r["route"] == "verifier":
            decided += 1
            m_ok = bool(mem is not None and equivalent(mem, gold))
            if z_ok == m_ok:
                both_wrong += not z_ok  # both right cannot happen: the answers differ
            else:
                one_right += 1
                scores = _scores(verifier, r, [zs, mem], run_samples, tie_samples)
                pick_memory = scores[1] > scores[0]
                new_ok = m_ok if pick_memory else z_ok
                run_right_pick += ok
                replay_right_pick += new_ok
                if new_ok != ok:
                    changed.append(
                        {"index": r["index"], "gold": gold, "zero_shot": zs, "memory": mem, "scores": scores}
                    )
                print(
                    f"  {run_dir.name} q{r['index']}: zs={zs} mem={mem} gold={gold} scores={scores} "
                    f"run {'right' if ok else 'wrong'} -> {'right' if new_ok else 'wrong'}",
                    flush=True,
                )
        zs_correct += z_ok
        run_correct += ok
        replay_correct += new_ok
        run_gains += ok and not z_ok
        run_losses += z_ok and not ok
        gains += new_ok and not z_ok
        losses += z_ok and not new_ok
    n = len(records)
    return {
        "run_dir": str(run_dir),
        "questions": n,
        "run_verifier": run["config"]["verifier"]["name"],
        "zero_shot_candidate_accuracy": zs_correct / n,
        "verifier_routed": decided,
        "one_right": one_right,
        "both_wrong": both_wrong,
        "run": {
            "accuracy": run_correct / n,
            "gains": run_gains,
            "losses": run_losses,
            "right_pick_when_one_right": f"{run_right_pick}/{one_right}",
        },
        verifier_name: {
            "accuracy": replay_correct / n,
            "gains": gains,
            "losses": losses,
            "right_pick_when_one_right": f"{replay_right_pick}/{one_right}",
        },
        "changed": changed,
        "seconds": round(time.perf_counter() - t0, 1),
    }, elm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--method", default="elm_input")
    ap.add_argument("--verifier", default="consistency", choices=["consistency"])
    ap.add_argument("--limit", type=int, default=None, help="first N questions of each run only")
    ap.add_argument("--tie-samples", type=int, default=0, help="replay consistency_tie_samples on consistency runs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    elm: ELM | None = None
    runs = []
    for run_dir in args.run_dirs:
        result, elm = replay_run(run_dir, args.method, args.verifier, elm, args.limit, args.tie_samples)
        runs.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "changed"}), flush=True)
    assert elm is not None

    def summary(key: str) -> dict[str, Any]:
        acc = [100 * r[key]["accuracy"] for r in runs]
        return {
            "mean_accuracy": round(statistics.mean(acc), 1),
            "std": round(statistics.stdev(acc), 1) if len(acc) > 1 else 0.0,
            "gains": sum(r[key]["gains"] for r in runs),
            "losses": sum(r[key]["losses"] for r in runs),
        }

    zs = [100 * r["zero_shot_candidate_accuracy"] for r in runs]
    report = {
        "method": args.method,
        "verifier": args.verifier,
        "tie_samples": args.tie_samples,
        "runs": runs,
        "mean": {
            "zero_shot_candidate": round(statistics.mean(zs), 1),
            "run": summary("run"),
            args.verifier: summary(args.verifier),
        },
        "environment": {k: v for k, v in collect_env(elm.config).items() if k in ("cpu", "resolved", "packages")},
    }
    elm.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["mean"], indent=1))


if __name__ == "__main__":
    main()
