"""The paper's training-free baselines: memories as *text* in the prompt.

``icl``            stores (question, its greedy chain of thought); retrieves the most similar
                   stored question and shows that solved example before the new question.
``reasoning_bank`` (Ouyang et al. 2025) solves, judges its own solution (no ground truth),
                   distils a short reusable strategy from the attempt, stores it; retrieves the
                   most similar strategy and prepends it.

Retrieval uses the run's key builder (``retrieval.key``) on the questions, like ELM. With
``kv`` keys both sides use the query projection (a text pool has no soft prompt to feed
the key projection). The pool is a JSONL file under ``<out>/pools/<method>``; keys are
recomputed from the stored questions when a run resumes (they are a pure function of the
question), so nothing but text is persisted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from elm_memory.answers import extract_answer
from elm_memory.backends.base import PromptInput, SamplingParams, answer_budget
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput, dir_bytes
from elm_memory.eval.records import RecordLog

#: Prompt shown before the new question when a solved example is retrieved (icl).
ICL_TEMPLATE = (
    "Here is a solved example of a similar problem.\n\nProblem: {example}\nSolution: {solution}\n\n"
    "Now solve this problem.\n{question}"
)
#: Prompt shown before the new question when a strategy is retrieved (reasoning_bank).
STRATEGY_TEMPLATE = "A strategy that helped on a similar problem: {strategy}\n\n{question}"
JUDGE_TEMPLATE = (
    "Problem: {question}\n\nProposed solution:\n{solution}\n\nCheck the solution step by step. Is its final "
    "answer correct? End your reply with exactly one line: VERDICT: correct, or VERDICT: incorrect."
)
DISTIL_TEMPLATE = (
    "Problem: {question}\n\nAttempted solution:\n{solution}\n\nA careful check judged this solution {verdict}. "
    "In at most two sentences, state one general strategy{purpose} for similar problems. Do not repeat this "
    "problem's numbers. Reply with the strategy only."
)


class TextPool:
    """Append-only (question, payload) entries with an in-memory cosine index."""

    def __init__(self, directory: Path, runtime: EvalRuntime):
        from elm_memory.memory.keys import key_builders

        self.dir = directory
        self.log = RecordLog(directory / "entries.jsonl")  # fsynced lines; one cut by a crash is skipped
        self.runtime = runtime
        self.key_builder = key_builders.get(runtime.config.retrieval.key)()
        self.entries: list[dict[str, Any]] = []
        self._keys: list[Any] = []
        for entry in self.log.read():
            self._append(entry)

    def _key(self, question: str) -> Any:
        import torch

        from elm_memory.memory.keys import tokenize_question

        ids = tokenize_question(self.runtime.loaded.tokenizer, question)
        key = self.key_builder.query_key(self.runtime.loaded, ids).detach().float().flatten()
        return torch.nn.functional.normalize(key, dim=0)

    def _append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        self._keys.append(self._key(entry["question"]))

    def __contains__(self, question_id: str) -> bool:
        return any(e["question_id"] == question_id for e in self.entries)

    def add(self, question_id: str, question: str, payload: str) -> None:
        """Idempotent per question id; the line is fsynced before it counts."""
        if question_id in self:
            return
        entry = {"question_id": question_id, "question": question, "payload": payload}
        self.log.append(entry)
        self._append(entry)

    def nearest(self, question: str) -> tuple[dict[str, Any], float] | None:
        if not self.entries:
            return None
        import torch

        scores = torch.stack(self._keys) @ self._key(question)
        best = int(torch.argmax(scores))
        return self.entries[best], float(scores[best])

    def stats(self) -> tuple[int, int]:
        return len(self.entries), dir_bytes(self.dir)


class _TextMemoryMethod:
    name = "text"

    def __init__(self, runtime: EvalRuntime):
        self.runtime = runtime
        self.pool = TextPool(runtime.out_dir / "pools" / self.name, runtime)

    def _generate(self, prompt: PromptInput, max_new_tokens: int, stop_at_answer: bool) -> Any:
        rt = self.runtime
        budget = answer_budget(max_new_tokens, rt.backend.info.max_context, len(prompt.token_ids))
        params = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_at_answer=stop_at_answer)
        [[gen]] = rt.backend.generate([prompt], params)
        return gen

    def _solve(self, question: str, context_text: str | None) -> Any:
        rt = self.runtime
        built = rt.prompts.build(context_text or question)
        g = rt.config.generation
        return self._generate(PromptInput(built.token_ids), g.max_new_tokens, g.stop_at_answer)

    def _chat(self, content: str, max_new_tokens: int) -> str:
        """A free-form instruction (judge, distil): the chat template without the math prompt."""
        tok = self.runtime.backend.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(content + "\n", add_special_tokens=True)["input_ids"]
        return self._generate(PromptInput(tuple(ids)), max_new_tokens, False).text.strip()

    def _contextualise(self, question: str, entry: dict[str, Any]) -> str:
        raise NotImplementedError

    def answer(self, question: str, index: int) -> MethodOutput:
        hit = self.pool.nearest(question)
        context_text = None if hit is None else self._contextualise(question, hit[0])
        gen = self._solve(question, context_text)
        answer = extract_answer(gen.text)
        return MethodOutput(
            answer=answer,
            response=gen.text,
            route="zero_shot" if hit is None else "context",
            memory_id=None if hit is None else hit[0]["question_id"],
            similarity=None if hit is None else hit[1],
            candidates=[{"kind": "context" if hit else "zero_shot", "answer": answer, "score": None}],
        )

    def pool_stats(self) -> tuple[int, int]:
        return self.pool.stats()

    def close(self) -> None:
        return None


class ICL(_TextMemoryMethod):
    name = "icl"

    def _contextualise(self, question: str, entry: dict[str, Any]) -> str:
        return ICL_TEMPLATE.format(example=entry["question"], solution=entry["payload"], question=question)

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        self.pool.add(question_id, question, output.response.strip())


class ReasoningBank(_TextMemoryMethod):
    name = "reasoning_bank"
    judge_tokens = 256
    strategy_tokens = 96

    def _contextualise(self, question: str, entry: dict[str, Any]) -> str:
        return STRATEGY_TEMPLATE.format(strategy=entry["payload"], question=question)

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        if question_id in self.pool:
            return
        judgement = self._chat(
            JUDGE_TEMPLATE.format(question=question, solution=output.response.strip()), self.judge_tokens
        )
        verdict = parse_verdict(judgement)
        purpose = " that made this solution work" if verdict == "correct" else " that avoids this mistake"
        strategy = self._chat(
            DISTIL_TEMPLATE.format(
                question=question, solution=output.response.strip(), verdict=verdict, purpose=purpose
            ),
            self.strategy_tokens,
        )
        output.extra["self_judgement"] = verdict
        self.pool.add(question_id, question, strategy or "(no strategy)")


def parse_verdict(text: str) -> str:
    """The last ``VERDICT: correct|incorrect``; anything else counts as ``incorrect`` (be sceptical)."""
    found = re.findall(r"verdict\s*[:\-]?\s*\**\s*(correct|incorrect)", text, flags=re.IGNORECASE)
    return found[-1].lower() if found else "incorrect"
