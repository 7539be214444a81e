"""Where does ELM's gain go? Replay a finished online run's memories under other placements and verifiers.

For every question of an ``elm stream`` run where ELM used a memory, this takes *the memory the
run retrieved* (its id is in the record; the pool is read from a copy of the run's store, so the
committed run is never touched), regenerates the memory-conditioned answer greedily with each
``prompt.soft_prompt_position`` and routes the pair (zero-shot, memory) again with each verifier.
Everything but the named knob stays as in the run (``run.json``), so the numbers answer:

- how good is the memory-conditioned candidate on its own, per placement (and the oracle:
  either candidate right);
- how often does each verifier pick the right candidate when exactly one is right;
- what ELM's accuracy, gains and losses (against its zero-shot candidate) would have been.

The zero-shot candidate is regenerated too (same batch size as the run's zero-shot method) and
checked against the recorded answers; ``prefix`` reproduces the run's own memory candidates
up to bf16 batch effects (the count of matches is in the output).

This is a replay, not an online run: memories were trained with the run's placement (S=1 in
``cpu-demo`` moves a soft prompt only slightly from its initialisation, so the placement mostly
moves the question-embedding initialisation) and retrieval is not repeated.

    python -m benchmarks.route_replay benchmarks/results/online_synth60_s42 \
        --positions prefix,user_turn --verifiers self_certainty,logprob --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import SamplingParams, answer_budget
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.environment import collect_env
from elm_memory.eval.records import RecordLog
from elm_memory.verifiers import Candidate, build_verifier


def _records(run_dir: Path, method: str) -> list[dict[str, Any]]:
    rows = RecordLog(run_dir / "records.jsonl").read()
    return sorted((r for r in rows if r["method"] == method), key=lambda r: r["index"])


def _generate(elm: ELM, prompts: list[Any], budget_ids: list[int], batch: int) -> list[Any]:
    """Greedy answers in batches of ``batch`` with the run's generation settings."""
    g, k = elm.config.generation, elm.config.memory.num_tokens
    out: list[Any] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        longest = max(budget_ids[i : i + batch])
        params = SamplingParams(
            max_new_tokens=answer_budget(g.max_new_tokens, elm.backend.info.max_context, longest, k),
            temperature=g.temperature,
            top_p=g.top_p,
            stop_at_answer=g.stop_at_answer,
            seed=elm.config.training.seed,
        )
        out += [gens[0] for gens in elm.backend.generate(chunk, params)]
        print(f"  generated {min(i + batch, len(prompts))}/{len(prompts)}", flush=True)
    return out


def _route(zs: dict[str, Any], mem: dict[str, Any], prefer_answered: bool, scores: list[float] | None) -> str:
    """Which candidate the graph's route/verify nodes would return ("zero_shot" or "memory")."""
    if equivalent(zs["answer"], mem["answer"]):
        return "zero_shot"  # agree: same answer either way
    if prefer_answered and (zs["answer"] is None) != (mem["answer"] is None):
        return "zero_shot" if zs["answer"] is not None else "memory"
    if scores is None:
        return "zero_shot"
    return "memory" if scores[1] > scores[0] else "zero_shot"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--method", default="elm_input")
    ap.add_argument("--positions", default="prefix,user_turn")
    ap.add_argument("--verifiers", default="self_certainty,logprob")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="first N questions of the run only")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    run = json.loads((args.run_dir / "run.json").read_text())
    base_cfg = ELMConfig.model_validate(run["config"])
    records = _records(args.run_dir, args.method)[: args.limit]
    gold = {r["question_id"]: r["gold"] for r in records}
    zs_records = {r["index"]: r for r in _records(args.run_dir, "zero_shot")}
    used = [r for r in records if r.get("memory_id")]
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        store_copy = Path(tmp) / "store"
        shutil.copytree(args.run_dir / "store", store_copy)
        cfg = base_cfg.model_copy(
            update={
                "namespace": args.method,
                "store": base_cfg.store.model_copy(update={"path": str(store_copy)}),
                "learner": base_cfg.learner.model_copy(update={"mode": "off"}),
            }
        )
        elm = ELM(cfg)
        assert elm.retriever is not None
        store = elm.retriever.store
        memories = {r["memory_id"]: store.get(r["memory_id"], args.method) for r in used}

        k = cfg.memory.num_tokens
        base_prompts = [elm.prompts.answer_prompt(r["question"], memory_tokens=k) for r in records]
        lengths = [len(p.token_ids) for p in base_prompts]
        zero_shot_prompt = {r["index"]: p.zero_shot() for r, p in zip(records, base_prompts, strict=True)}
        print(f"zero-shot candidates: {len(records)} questions", flush=True)
        zs_gens = _generate(elm, [zero_shot_prompt[r["index"]] for r in records], lengths, args.batch_size)
        zs = {
            r["index"]: {"answer": extract_answer(g.text), "text": g.text, "ids": tuple(g.token_ids)}
            for r, g in zip(records, zs_gens, strict=True)
        }
        zs_match = sum(equivalent(zs[i]["answer"], zs_records[i]["answer"]) for i in zs if i in zs_records)

        report: dict[str, Any] = {
            "run": str(args.run_dir),
            "method": args.method,
            "questions": len(records),
            "with_memory": len(used),
            "zero_shot_accuracy": sum(
                bool(equivalent(zs[r["index"]]["answer"], gold[r["question_id"]])) for r in records
            )
            / len(records),
            "zero_shot_matches_run": zs_match,
            "positions": {},
            "environment": {k2: v for k2, v in collect_env(cfg).items() if k2 in ("cpu", "resolved", "packages")},
        }
        verifiers = {
            name: build_verifier(
                cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"name": name})}), elm.backend
            )
            for name in args.verifiers.split(",")
        }
        for position in args.positions.split(","):
            pcfg = cfg.prompt.model_copy(update={"soft_prompt_position": position})
            builder = PromptBuilder(elm.backend.tokenizer, pcfg, max_context=elm.backend.info.max_context)
            print(f"memory candidates, {position}: {len(used)} questions", flush=True)
            mem_prompts = [builder.answer_prompt(r["question"], memory_tokens=k) for r in used]
            gens = _generate(
                elm,
                [p.with_memory(memories[r["memory_id"]].soft_prompt) for p, r in zip(mem_prompts, used, strict=True)],
                [len(p.token_ids) for p in mem_prompts],
                args.batch_size,
            )
            mem = {
                r["index"]: {"answer": extract_answer(g.text), "text": g.text, "ids": tuple(g.token_ids)}
                for r, g in zip(used, gens, strict=True)
            }
            recorded_mem = {
                r["index"]: next((c["answer"] for c in r["candidates"] if c["kind"] == "memory"), None) for r in used
            }
            right = {
                i: (bool(equivalent(zs[i]["answer"], gold[q])), bool(equivalent(mem[i]["answer"], gold[q])))
                for i, q in ((r["index"], r["question_id"]) for r in used)
            }
            disagree = [r for r in used if not equivalent(zs[r["index"]]["answer"], mem[r["index"]]["answer"])]
            entry: dict[str, Any] = {
                "memory_candidate_accuracy_on_used": sum(m for _, m in right.values()) / len(used),
                "zero_shot_accuracy_on_used": sum(z for z, _ in right.values()) / len(used),
                "oracle_on_used": sum(z or m for z, m in right.values()) / len(used),
                "memory_matches_run": sum(equivalent(mem[i]["answer"], recorded_mem[i]) for i in mem),
                "agree": len(used) - len(disagree),
                "only_memory_right": sum(m and not z for z, m in right.values()),
                "only_zero_shot_right": sum(z and not m for z, m in right.values()),
                "verifiers": {},
                # what the memory-conditioned answers look like (the first two, shortened)
                "examples": [
                    {
                        "question": r["question"][:200],
                        "gold": gold[r["question_id"]],
                        "memory_answer": mem[r["index"]]["text"][:400],
                    }
                    for r in used[:2]
                ],
            }
            for vname, verifier in verifiers.items():
                t0 = time.perf_counter()
                correct = gains = losses = picked_right = one_right = 0
                for r in records:
                    i, g0 = r["index"], gold[r["question_id"]]
                    z_ok = bool(equivalent(zs[i]["answer"], g0))
                    if i not in mem:
                        correct += z_ok
                        continue
                    scores = None
                    if not equivalent(zs[i]["answer"], mem[i]["answer"]) and not (
                        cfg.verifier.prefer_answered and (zs[i]["answer"] is None) != (mem[i]["answer"] is None)
                    ):
                        cands = [
                            Candidate(text=c["text"], token_ids=c["ids"], prompt=zero_shot_prompt[i], kind=kind)
                            for kind, c in (("zero_shot", zs[i]), ("memory", mem[i]))
                        ]
                        scores = verifier.score(r["question"], cands)
                    pick = _route(zs[i], mem[i], cfg.verifier.prefer_answered, scores)
                    ok = right[i][1] if pick == "memory" else z_ok
                    correct += ok
                    gains += ok and not z_ok
                    losses += z_ok and not ok
                    if right[i][0] != right[i][1]:
                        one_right += 1
                        picked_right += ok
                entry["verifiers"][vname] = {
                    "elm_accuracy": correct / len(records),
                    "gains": gains,
                    "losses": losses,
                    "right_pick_when_one_right": f"{picked_right}/{one_right}",
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                print(f"  {position} {vname}: {entry['verifiers'][vname]}", flush=True)
            report["positions"][position] = entry
        elm.close()
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k2: v for k2, v in report.items() if k2 != "environment"}, indent=1))


if __name__ == "__main__":
    main()
