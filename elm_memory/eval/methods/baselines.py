"""Memoryless baselines: greedy zero-shot, and k sampled answers picked by the verifier.

``verifier_at_2`` is the paper's compute-matched baseline (appendix): ELM spends two
generations per question (zero-shot + memory) and a verifier call when they disagree;
this baseline spends the same on two *sampled* zero-shot answers, so a gain of ELM over
it is due to the memory, not to the second sample or the verifier.
"""

from __future__ import annotations

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput


class _Memoryless:
    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        return None

    def pool_stats(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        return None


class ZeroShot(_Memoryless):
    """Greedy pass@1 through the ELM graph with no store: exactly ELM's zero-shot candidate."""

    name = "zero_shot"

    def __init__(self, runtime: EvalRuntime):
        self.runtime = runtime

    def answer(self, question: str, index: int) -> MethodOutput:
        r = self.runtime.base.answer(question, learn=False)
        return MethodOutput(
            answer=r.answer,
            response=r.response,
            route=r.route,
            candidates=[{"kind": "zero_shot", "answer": r.answer, "score": None}],
            warnings=r.warnings,
        )


class VerifierAtK(_Memoryless):
    """``k`` answers sampled at the rollout temperature; all agree -> that answer, else the
    verifier's best (ties: the first sample)."""

    def __init__(self, runtime: EvalRuntime, k: int = 2):
        if k < 2:
            raise ValueError("verifier_at_k needs k >= 2")
        self.runtime = runtime
        self.k = k
        self.name = f"verifier_at_{k}"

    def answer(self, question: str, index: int) -> MethodOutput:
        rt = self.runtime
        cfg = rt.config
        built = rt.prompts.build(question)
        g = cfg.generation
        room = rt.backend.info.max_context - len(built.token_ids)
        params = SamplingParams(
            max_new_tokens=max(1, min(g.max_new_tokens, room)),
            temperature=cfg.training.effective_temperature(rt.backend.info.model_type),
            top_p=g.top_p,
            n=self.k,
            seed=rt.seed_for(index),
            stop_at_answer=g.stop_at_answer,
        )
        prompt = PromptInput(built.token_ids)
        [gens] = rt.backend.generate([prompt], params)
        candidates = [
            {"kind": f"sample_{i}", "answer": extract_answer(gen.text), "score": None} for i, gen in enumerate(gens)
        ]
        first = candidates[0]["answer"]
        if all(equivalent(first, c["answer"]) for c in candidates[1:]):
            return MethodOutput(answer=first, response=gens[0].text, route="agree", candidates=candidates)
        from elm_memory.verifiers.base import Candidate

        scored = [Candidate(text=g.text, token_ids=tuple(g.token_ids), prompt=prompt, kind=c["kind"])
                  for g, c in zip(gens, candidates, strict=True)]  # fmt: skip
        scores = rt.base.verifier.score(question, scored)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        for c, s in zip(candidates, scores, strict=True):
            c["score"] = float(s) if s == s and abs(s) != float("inf") else None
        return MethodOutput(answer=candidates[best]["answer"], response=gens[best].text, route="verifier",
                            candidates=candidates)  # fmt: skip


def verifier_at_2(runtime: EvalRuntime) -> VerifierAtK:
    return VerifierAtK(runtime, k=2)
