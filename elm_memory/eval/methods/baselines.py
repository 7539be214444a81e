"""Memoryless baselines: greedy zero-shot, and k sampled answers picked by the verifier.

``verifier_at_2`` is the paper's compute-matched baseline (appendix): ELM spends two
generations per question (zero-shot + memory) and a verifier call when they disagree;
this baseline spends the same on two *sampled* zero-shot answers, so a gain of ELM over
it is due to the memory, not to the second sample or the verifier.
"""

from __future__ import annotations

from typing import Any

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import Generation, PromptInput, SamplingParams, answer_budget
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput


class _Memoryless:
    """Answers do not depend on earlier questions, so the runner may batch them across the stream."""

    memoryless = True

    def answer_batch(self, questions: list[str], indices: list[int]) -> list[MethodOutput]:
        raise NotImplementedError

    def answer(self, question: str, index: int) -> MethodOutput:
        return self.answer_batch([question], [index])[0]

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        return None

    def pool_stats(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        return None


class ZeroShot(_Memoryless):
    """Greedy pass@1 from the graph's zero-shot prompt (:meth:`PromptBuilder.answer_prompt`) and
    budget rule, so ELM's zero-shot candidate and this answer share one cache entry."""

    name = "zero_shot"

    def __init__(self, runtime: EvalRuntime):
        self.runtime = runtime

    def _prompt(self, question: str) -> PromptInput:
        k = self.runtime.config.memory.num_tokens
        return self.runtime.prompts.answer_prompt(question, memory_tokens=k).zero_shot()

    def _params(self, max_new: int) -> SamplingParams:
        cfg = self.runtime.config
        g = cfg.generation
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=g.temperature,
            top_p=g.top_p,
            stop_at_answer=g.stop_at_answer,
            seed=cfg.training.seed,
        )

    def answer_batch(self, questions: list[str], indices: list[int]) -> list[MethodOutput]:
        rt = self.runtime
        k = rt.config.memory.num_tokens
        gens = _generate_grouped(rt, [self._prompt(q) for q in questions], self._params, reserve=k)
        outputs = []
        for [gen] in gens:
            answer = extract_answer(gen.text)
            candidates = [{"kind": "zero_shot", "answer": answer, "score": None}]
            outputs.append(
                MethodOutput(
                    answer=answer,
                    response=gen.text,
                    route="zero_shot",
                    candidates=candidates,
                    # what a resumed run needs to put this very generation back in the cache
                    extra={"generation": {"token_ids": list(gen.token_ids), "finish_reason": gen.finish_reason}},
                )
            )
        return outputs

    def resume(self, records: list[dict[str, Any]]) -> int:
        """Put this method's recorded answers back in the run's greedy cache, so the ELM methods
        still to run get the same zero-shot candidate a run without the restart would have given
        them (regenerating it in another batch can change a bf16 answer). Returns how many."""
        rt = self.runtime
        if not self._params(1).greedy:  # sampled zero-shot answers are not shared
            return 0
        k = rt.config.memory.num_tokens
        restored = 0
        for r in records:
            kept = (r.get("extra") or {}).get("generation")
            if not kept:  # recorded before answers kept their tokens
                continue
            prompt = self._prompt(r["question"])
            budget = _budget(rt, prompt, k)
            generation = Generation(r["response"], list(kept["token_ids"]), kept["finish_reason"])
            rt.greedy_cache.put(prompt, self._params(budget), generation)
            restored += 1
        return restored


class VerifierAtK(_Memoryless):
    """``k`` answers sampled at the rollout temperature; all agree -> that answer, else the
    verifier's best (ties: the first sample)."""

    def __init__(self, runtime: EvalRuntime, k: int = 2):
        if k < 2:
            raise ValueError("verifier_at_k needs k >= 2")
        self.runtime = runtime
        self.k = k
        self.name = f"verifier_at_{k}"

    def answer_batch(self, questions: list[str], indices: list[int]) -> list[MethodOutput]:
        """One sampled call for the batch; each sample is its own row seeded from (run seed, question, sample
        index), so a question's samples are the same whichever batch it is in (see verifiers/seeding.py)."""
        from elm_memory.verifiers.seeding import sample_seeds, seeded_rows

        rt = self.runtime
        cfg = rt.config
        g = cfg.generation
        prompts = [rt.prompts.answer_prompt(q, memory_tokens=0).zero_shot() for q in questions]
        # a key of their own: these samples (at the rollout temperature) are not the consistency verifier's
        rows = [
            seeded_rows(p, sample_seeds(cfg.training.seed, f"{self.name}\x00{q}", self.k))
            for q, p in zip(questions, prompts, strict=True)
        ]
        flat = _generate_grouped(
            rt,
            [row for per_question in rows for row in per_question],
            lambda max_new: SamplingParams(
                max_new_tokens=max_new,
                temperature=cfg.training.effective_temperature(rt.backend.info.model_type),
                top_p=g.top_p,
                n=1,
                seed=cfg.training.seed,
                stop_at_answer=g.stop_at_answer,
            ),
        )
        gens_by_q = [[gens[0] for gens in flat[i * self.k : (i + 1) * self.k]] for i in range(len(questions))]
        return [self._route(q, p, gens) for q, p, gens in zip(questions, prompts, gens_by_q, strict=True)]

    def _route(self, question: str, prompt: PromptInput, gens: list) -> MethodOutput:
        rt = self.runtime
        candidates: list[dict[str, Any]] = [
            {"kind": f"sample_{i}", "answer": extract_answer(gen.text), "score": None} for i, gen in enumerate(gens)
        ]
        first = candidates[0]["answer"]
        if all(equivalent(first, c["answer"]) for c in candidates[1:]):
            return MethodOutput(answer=first, response=gens[0].text, route="agree", candidates=candidates)
        from elm_memory.verifiers.base import Candidate

        scored = [
            Candidate(text=g.text, token_ids=tuple(g.token_ids), prompt=prompt, kind=c["kind"])
            for g, c in zip(gens, candidates, strict=True)
        ]
        scores = rt.base.verifier.score(question, scored)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        for c, s in zip(candidates, scores, strict=True):
            c["score"] = float(s) if s == s and abs(s) != float("inf") else None
        return MethodOutput(
            answer=candidates[best]["answer"], response=gens[best].text, route="verifier", candidates=candidates
        )


def verifier_at_2(runtime: EvalRuntime) -> VerifierAtK:
    return VerifierAtK(runtime, k=2)


def _generate_grouped(rt: EvalRuntime, prompts: list[PromptInput], make_params, reserve: int = 0) -> list[list]:
    """Generate for ``prompts`` with each one's answer budget capped by the context left, as the
    graph does; prompts sharing a budget share one batched call. Returns completions per prompt."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(_budget(rt, p, reserve), []).append(i)
    out: list[list] = [[] for _ in prompts]
    for max_new, members in groups.items():
        results = rt.backend.generate([prompts[i] for i in members], make_params(max_new))
        for i, gens in zip(members, results, strict=True):
            out[i] = gens
    return out


def _budget(rt: EvalRuntime, prompt: PromptInput, reserve: int = 0) -> int:
    """The graph's answer budget for ``prompt`` (equal prompts, equal budgets: the cache's key relies on it)."""
    limit = rt.config.generation.max_new_tokens
    return answer_budget(limit, rt.backend.info.max_context, len(prompt.token_ids), reserve)
