"""The paper's LAG baseline (log-augmented generation, Chen et al. 2025): memories as *KV caches*.

``lag``      after answering a question, stores its log, the model's own exchange (the
             question's prompt + the greedy answer + the end of the turn), as the per-layer
             keys and values of one forward pass over it. On a new question it retrieves
             the most similar log and generates greedily with that KV cache prepended to
             the prompt (the log's tokens are not re-encoded).
``lag_tts``  the same, but the log's answer is one that wins a majority vote: G =
             ``training.num_generations`` completions sampled at the training temperature,
             the first whose ``\\boxed{}`` answer equals the majority answer (paper appendix,
             "LAG-TTS"). No answer among them: the greedy answer is logged.

Retrieval is by question: the run's key builder (``retrieval.key``) on the logged question,
compared with the new question's key, as ``icl`` does. LAG's authors also retrieve a log by
embedding its task's question, and a question-to-question match is symmetric (a new question
has no answer yet to match a log's answer text against).

Where a log is stored whole (LAG keeps only its last response's KV): a prefix computed at
positions ``0..T-1`` and placed there again needs no re-rotation of its keys, and generating
after it equals generating after its tokens written out (``tests/test_lag.py`` checks this).
When log + prompt + ``generation.max_new_tokens`` would overflow the model's context, the log
is skipped (recorded in ``extra.log_skipped``) and the question answered zero-shot.

The pool lives in ``<out>/pools/<method>/``: ``entries.jsonl`` (question_id, question, the log's
text, its file) and ``kv/<file>.safetensors``. Only the ``hf`` backend holds the model whose
cache can be prepended; other backends are refused before any work.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent, extract_answer, majority_vote
from elm_memory.backends.base import PromptInput, SamplingParams, answer_budget
from elm_memory.backends.kv_prefix import KVPrefix, encode_prefix, generate_after_prefix, load_prefix, save_prefix
from elm_memory.backends.postprocess import eos_ids_of
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput
from elm_memory.eval.methods.text_memory import TextPool

#: Marks where the assistant's text goes when the chat template's end-of-turn is looked up.
_SENTINEL = "\u2063LOG_END\u2063"


class KVLogPool(TextPool):
    """A :class:`TextPool` whose entries also name a KV prefix file under ``kv/``; ``payload`` is the log's text."""

    def add_log(self, question_id: str, question: str, log_text: str, prefix: KVPrefix, fingerprint: str) -> None:
        """Idempotent per question id. The KV file is written (atomically) before its index line, so
        a crash leaves at most an unindexed file, overwritten when the question is learned again."""
        if question_id in self:
            return
        file = f"kv/{hashlib.sha256(question_id.encode()).hexdigest()[:24]}.safetensors"
        save_prefix(prefix, self.dir / file, fingerprint=fingerprint)
        entry = {"question_id": question_id, "question": question, "payload": log_text, "file": file}
        self.log.append(entry)
        self._append(entry)

    def load(self, entry: dict[str, Any]) -> KVPrefix:
        return load_prefix(self.dir / entry["file"], self.runtime.loaded.info)


class LAG:
    """``lag``: log the greedy answer; answer with the most similar log's KV cache prepended."""

    name = "lag"

    def __init__(self, runtime: EvalRuntime):
        backend = runtime.config.backend.name
        if backend != "hf":
            raise ConfigError(
                f"{self.name} prepends a stored KV cache to the prompt, which only the 'hf' backend can do; "
                f"backend.name is {backend!r} (run {self.name} with backend.name: hf)"
            )
        self.runtime = runtime
        self.pool = KVLogPool(Path(runtime.out_dir) / "pools" / self.name, runtime)
        self._turn_end: list[int] | None = None

    # -- answering ---------------------------------------------------------------------
    def answer(self, question: str, index: int) -> MethodOutput:
        rt = self.runtime
        g = rt.config.generation
        prompt = rt.prompts.answer_prompt(question, memory_tokens=0).token_ids
        hit = self.pool.nearest(question)
        extra: dict[str, Any] = {}
        warnings: list[str] = []
        gen = None
        if hit is not None:
            entry, similarity = hit
            prefix = self.pool.load(entry)
            needed = prefix.length + len(prompt) + g.max_new_tokens
            if needed <= rt.loaded.info.max_context:
                gen = generate_after_prefix(
                    rt.loaded.model,
                    rt.loaded.tokenizer,
                    prefix,
                    prompt,
                    max_new_tokens=g.max_new_tokens,
                    eos_ids=self._eos_ids(),
                    stop_at_answer=g.stop_at_answer,
                )
                extra = {"log_question": entry["question"], "log_tokens": prefix.length}
            else:
                extra["log_skipped"] = {
                    "question_id": entry["question_id"],
                    "reason": "context",
                    "tokens_needed": needed,
                    "max_context": rt.loaded.info.max_context,
                }
                warnings.append(f"log of {entry['question_id']} skipped: {needed} tokens exceed the context")
        if gen is None:  # empty pool or skipped log: the plain greedy answer (shared with zero_shot's cache)
            budget = answer_budget(g.max_new_tokens, rt.backend.info.max_context, len(prompt))
            params = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_at_answer=g.stop_at_answer)
            [[gen]] = rt.backend.generate([PromptInput(prompt)], params)
        used = hit if "log_question" in extra else None
        answer = extract_answer(gen.text)
        return MethodOutput(
            answer=answer,
            response=gen.text,
            route="context" if used else "zero_shot",
            memory_id=used[0]["question_id"] if used else None,
            similarity=used[1] if used else None,
            candidates=[{"kind": "context" if used else "zero_shot", "answer": answer, "score": None}],
            warnings=warnings,
            extra=extra,
        )

    # -- learning ----------------------------------------------------------------------
    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        if question_id in self.pool:  # resumed: the log is on disk already
            return
        self._store(question, question_id, self._log_answer(question, question_id, output))

    def _log_answer(self, question: str, question_id: str, output: MethodOutput) -> str:
        """The answer text the log holds: here, the greedy answer just given."""
        return output.response

    def _store(self, question: str, question_id: str, answer_text: str) -> None:
        """Encode prompt + answer + end of turn in one forward pass and add it to the pool. The answer
        is re-tokenised from its text: the index's log text is exactly what was encoded."""
        rt = self.runtime
        tok = rt.loaded.tokenizer
        prompt = rt.prompts.answer_prompt(question, memory_tokens=0).token_ids
        answer_ids = tok(answer_text.strip(), add_special_tokens=False)["input_ids"]
        ids = list(prompt) + list(answer_ids) + self._turn_end_ids()
        # a log longer than the context could never be prepended: keep its newest tokens
        ids = ids[-(rt.loaded.info.max_context - 1) :]
        prefix = encode_prefix(rt.loaded.model, ids)
        log_text = tok.decode(ids, skip_special_tokens=False)
        self.pool.add_log(question_id, question, log_text, prefix, rt.loaded.info.fingerprint)

    def _turn_end_ids(self) -> list[int]:
        """What closes an assistant turn in the chat template (e.g. ``<|im_end|>\\n``); a blank line without one."""
        if self._turn_end is None:
            tok = self.runtime.loaded.tokenizer
            text = "\n\n"
            if self.runtime.prompts.use_chat:
                rendered = tok.apply_chat_template(
                    [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
                )
                if _SENTINEL in rendered:
                    text = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :] or text
            self._turn_end = list(tok(text, add_special_tokens=False)["input_ids"])
        return self._turn_end

    def _eos_ids(self) -> list[int]:
        model = self.runtime.loaded.model
        return eos_ids_of(model.generation_config.eos_token_id, self.runtime.loaded.tokenizer)

    def pool_stats(self) -> tuple[int, int]:
        return self.pool.stats()

    def close(self) -> None:
        return None


class LAGTTS(LAG):
    """``lag_tts``: the logged answer is a majority-vote winner among G sampled completions."""

    name = "lag_tts"

    def _log_answer(self, question: str, question_id: str, output: MethodOutput) -> str:
        rt = self.runtime
        cfg = rt.config
        g = cfg.generation
        prompt = rt.prompts.answer_prompt(question, memory_tokens=0).token_ids
        # seeded by the question id, so a resumed run samples what the first run would have
        seed = random.Random(f"{cfg.training.seed}:{self.name}:{question_id}").randrange(2**31)
        params = SamplingParams(
            # the answer length, not the rollout cap: the log should hold a whole solution
            max_new_tokens=answer_budget(g.max_new_tokens, rt.backend.info.max_context, len(prompt)),
            temperature=cfg.training.effective_temperature(rt.backend.info.model_type),
            top_p=g.top_p,
            n=cfg.training.num_generations,
            seed=seed,
            stop_at_answer=g.stop_at_answer,
        )
        [samples] = rt.backend.generate([PromptInput(prompt)], params)
        answers = [extract_answer(s.text) for s in samples]
        vote = majority_vote(answers)
        chosen = next(
            (i for i, a in enumerate(answers) if vote.answer is not None and equivalent(a, vote.answer)), None
        )
        output.extra["log_vote"] = {
            "answers": answers,
            "majority": vote.answer,
            "count": vote.count,
            "total": vote.total,
            "rollout": chosen,  # None: no sample had an answer, the greedy answer is logged
        }
        return samples[chosen].text if chosen is not None else output.response


def lag(runtime: EvalRuntime) -> LAG:
    return LAG(runtime)


def lag_tts(runtime: EvalRuntime) -> LAGTTS:
    return LAGTTS(runtime)
