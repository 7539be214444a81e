"""Benchmark: latency of the ELM answer path (retrieve + dual-generate + route) vs zero-shot
alone, on the same backend, model and questions, in one run.

Memories are created untrained (S=0, initialised from the question, as every memory
starts): latency does not depend on what a memory learned, only on its shape. The
verifier's cost is reported separately (it runs only when the two answers disagree).

    .venv/bin/python -m benchmarks.answer_latency              # default model, 6 GSM8K questions
    .venv/bin/python -m benchmarks.answer_latency --quick      # SmolLM2, 3 questions

Writes ``benchmarks/results/answer_latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "answer_latency.json"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--n", type=int, default=6, help="questions timed (after the memory-seeding ones)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def _time_answers(elm: Any, zero_shot: Any, tests: list[Any]) -> list[dict[str, Any]]:
    """Per question: the zero-shot answer's time, then the full ELM answer's time and its parts."""
    rows = []
    for p in tests:
        t0 = time.perf_counter()
        zs = zero_shot.answer(p.question, learn=False)
        t1 = time.perf_counter()
        full = elm.answer(p.question, learn=False)
        t2 = time.perf_counter()
        rows.append(
            {
                "id": p.id,
                "zero_shot_s": t1 - t0,
                "elm_s": t2 - t1,
                "route": full.route,
                "similarity": full.similarity,
                "retrieve_s": full.timings.get("retrieve", 0.0),
                "dual_generate_s": full.timings.get("dual_generate", 0.0),
                "verifier_s": full.timings.get("verify", 0.0),
                "zero_shot_tokens": sum(len(c.get("token_ids", [])) for c in zs.candidates),
                "elm_tokens": [len(c.get("token_ids", [])) for c in full.candidates],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _ratio(rows: list[dict[str, Any]], route: str | None) -> dict[str, Any] | None:
    """ELM time over zero-shot time, on the questions that took ``route`` (None: all)."""
    sel = [r for r in rows if route is None or r["route"] == route]
    if not sel:
        return None
    return {
        "n": len(sel),
        "mean_ratio": statistics.mean(r["elm_s"] / r["zero_shot_s"] for r in sel),
        "median_ratio": statistics.median(r["elm_s"] / r["zero_shot_s"] for r in sel),
        "ratio_without_verifier": statistics.mean((r["elm_s"] - r["verifier_s"]) / r["zero_shot_s"] for r in sel),
    }


def main() -> None:
    args = _args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM
    from elm_memory.eval.datasets import load_dataset

    preset = "cpu-tiny" if args.quick else args.preset
    n = 3 if args.quick else args.n
    store = tempfile.mkdtemp(prefix="elm-bench-")
    cfg = ELMConfig.load(
        preset=preset,
        overrides={
            "store": {"path": store},
            "training": {"steps": 0},
            "learner": {"mode": "off"},
            "generation": {"max_new_tokens": args.max_new_tokens},
            "retrieval": {"skip_no_consensus": False},
        },
    )
    seeds = load_dataset("gsm8k", limit=n)  # memories come from these...
    tests = load_dataset("gsm8k", limit=n, offset=n)  # ...and are retrieved for these
    elm = ELM(cfg)
    elm.services()  # build every part before timing
    zero_shot = ELM(
        cfg.model_copy(update={"store": cfg.store.model_copy(update={"kind": "none"})}),
        loaded=elm.loaded,
        backend=elm.backend,
        verifier=elm.verifier,
    )
    for p in seeds:
        elm.learn(p.question)
    # warm-up: first calls pay one-off kernel set-up costs
    zero_shot.answer(tests[0].question, learn=False)
    rows = _time_answers(elm, zero_shot, tests)
    result = {
        "benchmark": "answer_latency",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "settings": {
            "preset": preset,
            "model": cfg.model.name_or_path,
            "verifier": cfg.verifier.name,
            "max_new_tokens": args.max_new_tokens,
            "questions": len(rows),
        },
        "rows": rows,
        "all": _ratio(rows, None),
        "agree": _ratio(rows, "agree"),
        "verifier": _ratio(rows, "verifier"),
        "mean_verifier_s": statistics.mean([r["verifier_s"] for r in rows if r["route"] == "verifier"] or [0.0]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for key in ("all", "agree", "verifier"):
        if result[key]:
            r = result[key]
            print(
                f"{key:8} n={r['n']}  ELM/zero-shot mean {r['mean_ratio']:.2f}  median {r['median_ratio']:.2f}  "
                f"without verifier {r['ratio_without_verifier']:.2f}"
            )
    print(f"mean verifier cost when used: {result['mean_verifier_s']:.2f} s; written to {args.out}")
    elm.close()


if __name__ == "__main__":
    main()
