"""Benchmark: is a bigger packaged model worth its CPU cost for learning memories?

A memory learns only when its rollouts agree: the TTRL reward is 1 for a rollout whose answer is the
group's majority, so a group of G different answers carries almost no signal. For each model, on the
same synth-arith (or GSM8K) dev questions, in one run and one subprocess per model:

- the greedy zero-shot answer (right or not, seconds, tokens);
- S training steps of G rollouts from the question's untrained soft prompt (``learn_memory``, the
  preset's recipe): how often the rollouts agree (majority share), how often they box an answer, whether
  the majority (TTRL's pseudo-label) is right, seconds and tokens per step.

    .venv/bin/python -m benchmarks.model_candidates --model packaged:qwen2.5-coder-0.5b \\
        --model /path/to/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf --questions 12

Writes ``benchmarks/results/model_candidates.json`` and prints a markdown table. Dev questions only
(``elm_memory.eval.sweep.dev_problems``): never the first 60 questions of a reported stream seed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "model_candidates.json"


def _config(args: argparse.Namespace, model: str) -> Any:
    from elm_memory.config import ELMConfig

    return ELMConfig.load(
        preset=args.preset,
        overrides={
            "model": {"name_or_path": model},
            "training": {
                "steps": args.steps,
                "num_generations": args.generations,
                "max_completion_length": args.cap,
                "seed": 0,
            },
        },
    )


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One model, every dev question: runs in its own process so peak memory is the model's own."""
    from elm_memory.answers import equivalent, extract_answer
    from elm_memory.answers.vote import majority_vote
    from elm_memory.backends.base import SamplingParams
    from elm_memory.elm import ELM
    from elm_memory.eval.sweep import dev_problems
    from elm_memory.training.learn import learn_memory

    cfg = _config(args, args.child)
    t0 = time.perf_counter()
    elm = ELM.from_config(cfg)
    loaded, backend, prompts = elm.loaded, elm.backend, elm.prompts
    load_s = time.perf_counter() - t0
    k = cfg.memory.num_tokens
    greedy = SamplingParams(max_new_tokens=cfg.generation.max_new_tokens, stop_at_answer=cfg.generation.stop_at_answer)
    rows = []
    for i, p in enumerate(dev_problems(args.dataset, args.questions, per_family=1)):
        t = time.perf_counter()
        [[gen]] = backend.generate([prompts.answer_prompt(p.question, memory_tokens=k).zero_shot()], greedy)
        greedy_s = time.perf_counter() - t
        answer = extract_answer(gen.text)
        t = time.perf_counter()
        memory = learn_memory(p.question, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
        learn_s = time.perf_counter() - t
        stats = memory.meta.stats
        steps = []
        for answers in stats.answers:
            vote = majority_vote(answers)
            steps.append(
                {
                    "answers": answers,
                    "boxed": sum(a is not None for a in answers) / len(answers),
                    "majority": vote.answer,
                    "share": vote.share,
                    "majority_right": vote.answer is not None and equivalent(vote.answer, p.answer),
                }
            )
        rows.append(
            {
                "id": p.id,
                "family": p.family,
                "gold": p.answer,
                "greedy": answer,
                "greedy_right": answer is not None and equivalent(answer, p.answer),
                "greedy_s": round(greedy_s, 2),
                "greedy_tokens": len(gen.token_ids),
                "learn_s": round(learn_s, 2),
                "rollout_tokens": stats.completion_tokens,
                "steps": steps,
            }
        )
        print(
            f"[{args.child}] {i + 1}/{args.questions} greedy {answer!r} (gold {p.answer!r}) {greedy_s:.1f}s; "
            f"rollouts {[s['answers'] for s in steps]} {learn_s:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    elm.close()
    return {
        "model": args.child,
        "load_s": round(load_s, 1),
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "dtype": str(next(loaded.model.parameters()).dtype),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers that decide: accuracy, rollout agreement and what each costs."""
    steps = [s for r in rows for s in r["steps"]]
    n = len(rows)
    learn_s = sum(r["learn_s"] for r in rows)
    greedy_s = sum(r["greedy_s"] for r in rows)
    return {
        "questions": n,
        "zero_shot_right": sum(r["greedy_right"] for r in rows),
        "steps": len(steps),
        "mean_majority_share": round(sum(s["share"] for s in steps) / len(steps), 3) if steps else None,
        "steps_share_at_least_half": sum(s["share"] >= 0.5 for s in steps),
        "steps_unanimous": sum(s["share"] == 1.0 for s in steps),
        "boxed_rate": round(sum(s["boxed"] for s in steps) / len(steps), 3) if steps else None,
        "pseudo_label_right": sum(s["majority_right"] for s in steps),
        "greedy_s_per_question": round(greedy_s / n, 2) if n else None,
        "learn_s_per_step": round(learn_s / len(steps), 2) if steps else None,
        "greedy_tokens_per_s": round(sum(r["greedy_tokens"] for r in rows) / greedy_s, 2) if greedy_s else None,
        "rollout_tokens_per_s": round(sum(r["rollout_tokens"] for r in rows) / learn_s, 2) if learn_s else None,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| model | zero-shot right | mean majority share | steps with share ≥ 0.5 | unanimous | boxed | "
        "majority right | greedy s/question | learning s/step | rollout tok/s | peak RSS GiB |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in results:
        s = r["summary"]
        lines.append(
            f"| {Path(r['model']).name} | {s['zero_shot_right']}/{s['questions']} | {s['mean_majority_share']} | "
            f"{s['steps_share_at_least_half']}/{s['steps']} | {s['steps_unanimous']}/{s['steps']} | "
            f"{s['boxed_rate']} | "
            f"{s['pseudo_label_right']}/{s['steps']} | {s['greedy_s_per_question']} | {s['learn_s_per_step']} | "
            f"{s['rollout_tokens_per_s']} | {r['peak_rss_gib']} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="packaged alias or .gguf path (repeatable)")
    parser.add_argument("--dataset", default="synth-arith")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--cap", type=int, default=384, help="rollout token cap")
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    models = args.model or ["packaged:qwen2.5-coder-0.5b"]
    from elm_memory.environment import collect_env

    results = []
    for model in models:
        cmd = [sys.executable, "-m", "benchmarks.model_candidates", "--child", model]
        for flag in ("dataset", "questions", "steps", "generations", "cap", "preset"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = markdown(results)
    print(table)
    settings = {k: getattr(args, k) for k in ("dataset", "questions", "steps", "generations", "cap", "preset")}
    env = collect_env(_config(args, models[0]))
    payload = {"command": " ".join(sys.argv), "settings": settings, "env": env, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
