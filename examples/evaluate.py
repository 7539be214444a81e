"""Compare ELM with baselines on a short stream, from Python (the `elm stream` command does the same).

    python examples/evaluate.py                 # Qwen, cpu-demo preset, 5 GSM8K questions: about 15 min on 2 cores
    python examples/evaluate.py --tiny          # SmolLM2 plumbing run in about a minute (it never answers)

Writes records.jsonl, summary.json, results.md and plots to elm-runs/example-*; re-running resumes.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from elm_memory.config import ELMConfig  # noqa: E402
from elm_memory.eval.datasets import load_problems  # noqa: E402
from elm_memory.eval.online import run_stream  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="SmolLM2-135M and 12-token answers: wiring only")
    parser.add_argument("--limit", type=int, default=5)
    args = parser.parse_args()
    preset = "cpu-tiny" if args.tiny else "cpu-demo"
    overrides = {"generation": {"max_new_tokens": 12}} if args.tiny else {}
    config = ELMConfig.load(preset=preset, overrides=overrides)
    problems = load_problems("gsm8k", limit=args.limit, seed=17)
    result = run_stream(
        problems,
        ["zero_shot", "verifier_at_2", "elm_input"],
        config,
        f"elm-runs/example-{preset}-{args.limit}",
        dataset="gsm8k",
        seed=17,
        on_record=lambda r: print(f"{r['method']:<14} {r['question_id']}: {r['answer']} (gold {r['gold']})"),
    )
    print(result.table)
    for path in result.plots:
        print("plot:", path)


if __name__ == "__main__":
    main()
