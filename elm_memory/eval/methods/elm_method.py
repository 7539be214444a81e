"""ELM in the online protocol: answer through the ELM graph, then learn a memory (sync).

Each ELM method keeps its pool in ``<out>/store`` (a store of the configured ``store.kind``)
under its own namespace (its name), so ``elm_input`` and ``elm_kv`` in one run never see each
other's memories, and a resumed run finds the pool it left. The learner's job ids are derived
from (model, namespace, question): re-submitting a question whose memory exists after a crash
is a no-op.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from elm_memory.answers import extract_answer
from elm_memory.backends.base import SamplingParams
from elm_memory.backends.fusing import FusedCalls
from elm_memory.backends.prompting import AnswerPrompt
from elm_memory.elm import ELM
from elm_memory.errors import ELMError
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput, memory_store_config
from elm_memory.eval.records import training_votes
from elm_memory.graph.nodes import answer_params
from elm_memory.jobs.records import ticket_summary
from elm_memory.store.base import MemoryStoreBase
from elm_memory.training.merging import initial_prompt

log = logging.getLogger("elm_memory.eval")


class ELMMethod:
    def __init__(self, runtime: EvalRuntime, key: str, name: str, *, steps: int | None = None):
        """``steps``: S for this method's memories (None: ``training.steps``); 0 stores each memory's
        initial soft prompt untrained (``elm_untrained``)."""
        self.name = name
        self.runtime = runtime
        cfg = memory_store_config(runtime.config, runtime.out_dir, name)
        if steps is not None:
            cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": steps})})
        store_dir = runtime.out_dir / "store"
        self.config = cfg.model_copy(
            update={
                "namespace": name,
                "retrieval": cfg.retrieval.model_copy(update={"key": key}),
                "learner": cfg.learner.model_copy(
                    update={"mode": "sync", "queue_path": str(store_dir / f"learner-{name}.sqlite3")}
                ),
            }
        )
        base = runtime.base
        # answering and learning one question run side by side, their decodes batched together
        self.fused = FusedCalls(base.backend)
        # only where the backend batches calls; otherwise (e.g. vLLM) the run answers, then learns
        self.overlap = self.config.learner.overlap_answering and self.fused.can_fuse
        # the runtime's verifier is shared (a PRM is loaded once), but `consistency` samples through
        # generate(): built here on the fused view, its samples join the batches and decode in this thread
        verifier = None if self.config.verifier.name == "consistency" else base.verifier
        self.elm = ELM(self.config, loaded=base.loaded, backend=self.fused.backend, verifier=verifier)
        self._baseline_sampler: Any = None  # a consistency sampler for the paired baselines, built on first use
        self._bytes: dict[str, int] = {}  # memory id -> bytes of its stored form (a memory never changes)

    def resume(self, records: list[dict[str, Any]]) -> int:
        """Roll this method's pool and learn queue back to what its ``records`` account for; returns
        how many memories were removed.

        A run stopped after a question's memory was stored but before its record was written would
        answer that question again with its own memory in the pool (seen once: similarity 1.00). So
        every memory and learn job no record names goes: the question is answered from the pool it
        had, and its memory is learned again."""
        jobs: list[dict[str, Any]] = []
        for r in records:
            job = (r.get("extra") or {}).get("learn_job")
            if not job:  # recorded before records named their learn job: nothing safe to compare
                log.warning("%s: records without their learn job; the pool is resumed as it is", self.name)
                return 0
            jobs.append(job)
        kept_jobs = {j["job_id"] for j in jobs}
        kept_memories = {j["memory_id"] for j in jobs if j.get("memory_id")}
        queue = getattr(self.elm.learner, "queue", None)
        if queue is not None:
            for queued in queue.list():
                if queued.job.namespace == self.name and queued.job_id not in kept_jobs:
                    queue.forget(queued.job_id)
        retriever = self.elm.retriever
        if retriever is None:  # not built: the method refuses store.kind none
            return 0
        removed = 0
        for rec in retriever.store.list(self.name):
            if rec.id not in kept_memories:
                removed += retriever.store.delete(rec.id, self.name)
        if removed:
            log.info(
                "%s: removed %d memories learned from questions with no record; they are learned again",
                self.name,
                removed,
            )
        return removed

    def answer(self, question: str, index: int) -> MethodOutput:
        r = self.elm.answer(question, namespace=self.name, learn=False)
        return MethodOutput(
            answer=r.answer,
            response=r.response,
            route=r.route,
            memory_id=r.memory_id,
            similarity=r.similarity,
            candidates=[
                {"kind": c.get("kind"), "answer": c.get("answer"), "score": c.get("score")} for c in r.candidates
            ],
            warnings=r.warnings,
            extra={
                **self._extra(r),
                **self._decided_by(question, r),
                **(self._paired(question, r) if self.runtime.paired else {}),
            },
        )

    def _paired(self, question: str, r: Any) -> dict[str, Any]:
        """What the paired baselines (:mod:`elm_memory.eval.paired`) need beyond ELM's own generations:
        the untrained twin's answer (the retrieved memory's initial soft prompt, greedy, the answer's
        params) and, where ELM drew no verifier samples, the k samples self-consistency would vote on.
        Both decode on this method's fused backend, so while learning runs they join its batches."""
        out: dict[str, Any] = {}
        prompt = self.elm.prompts.answer_prompt(question, memory_tokens=self.config.memory.num_tokens)
        params = answer_params(self.config, prompt, self.fused.backend.info.max_context)
        if not (r.verifier_sample_answers or r.presampled_answers):  # none drawn, or the verifier scored none
            sampler = self._sampler()
            prompts, sample_params = sampler.sample_request(question)
            # cut at the answers' budget as the samples drawn ahead are, so every question's vote is alike
            budget = min(sample_params.max_new_tokens, params.max_new_tokens)
            gens = self.fused.backend.generate(prompts, dataclasses.replace(sample_params, max_new_tokens=budget))
            out["baseline_sample_answers"] = sampler.sample_answers_of([g for per_row in gens for g in per_row])
        if r.memory_id:
            out["untrained_twin"] = self._untrained_twin(r.memory_id, prompt, params)
        return out

    def _sampler(self) -> Any:
        if self._baseline_sampler is None:
            from elm_memory.verifiers.consistency import ConsistencyVerifier

            self._baseline_sampler = ConsistencyVerifier.from_config(self.config, self.fused.backend)
        return self._baseline_sampler

    def _untrained_twin(self, memory_id: str, prompt: AnswerPrompt, params: SamplingParams) -> dict[str, Any]:
        """The answer the retrieved memory gives untrained: its initial soft prompt rebuilt from its question
        and recorded recipe (:func:`~elm_memory.training.merging.initial_prompt`). In its own decode call,
        so in bf16 its tokens may differ by rounding from the same prompt decoded in a batch."""
        retriever = self.elm.retriever
        try:
            memory = retriever.store.get(memory_id, self.name) if retriever is not None else None
        except ELMError as exc:
            return {"memory_id": memory_id, "answer": None, "skipped": f"memory unreadable: {exc}"}
        if memory is None or memory.kind != "soft_prompt":
            return {"memory_id": memory_id, "answer": None, "skipped": "not a soft prompt"}
        if memory.meta.merged_from:  # its init was no one question's embeddings
            return {"memory_id": memory_id, "answer": None, "skipped": "a merged memory"}
        init = initial_prompt(memory, self.runtime.loaded, self.config)
        [[gen]] = self.fused.backend.generate([prompt.with_memory(init)], params)
        moved = (memory.soft_prompt - init).norm() / init.norm().clamp_min(1e-12)
        return {
            "memory_id": memory_id,
            "answer": extract_answer(gen.text),
            "response": gen.text,
            "moved": round(float(moved), 5),  # how far training took the memory from its init (relative norm)
        }

    @staticmethod
    def _extra(r: Any) -> dict[str, Any]:
        """The gate's decision and, where a sampling verifier scored, how many samples it drew (its cost)."""
        extra: dict[str, Any] = {}
        if r.gate is not None:
            extra["gate"] = r.gate
        if r.verifier_sample_answers is not None:
            extra["verifier_samples"] = len(r.verifier_sample_answers)
        return extra

    def _decided_by(self, question: str, r: Any) -> dict[str, Any]:
        """What decided the answer, for counterfactuals read from the record: the verifier's sample answers
        (scored, or drawn ahead and unused) with their seeds, the retrieved memory's training votes, and
        the seeds of the greedy answers and the rollouts."""
        out: dict[str, Any] = {"seeds": self._seeds()}
        samples = r.verifier_sample_answers if r.verifier_sample_answers is not None else r.presampled_answers
        if samples is not None:
            out["verifier_sample_answers"] = list(samples)
            out["verifier_samples_scored"] = r.verifier_sample_answers is not None
            seeds_of = getattr(self.elm.verifier, "sample_seeds", None)
            if callable(seeds_of):
                out["seeds"]["verifier_samples"] = seeds_of(question, len(samples))
        if r.memory_id:
            out["memory_votes"] = self._votes_of(r.memory_id)
        return out

    def _seeds(self) -> dict[str, Any]:
        t = self.config.training
        rollouts = None if t.seed is None else [t.seed + step for step in range(t.steps)]
        return {"run": t.seed, "rollout_steps": rollouts}

    def _votes_of(self, memory_id: str) -> dict[str, Any] | None:
        """A memory's training votes: per step, each rollout answer and how many rollouts gave it."""
        retriever = self.elm.retriever
        if retriever is None:
            return None
        try:
            stats = retriever.store.get(memory_id, self.name).meta.stats
        except ELMError:  # gone or unreadable: the record says so instead of failing the run
            return None
        return training_votes(stats)

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        self._note_ticket(output, self.elm.learner.submit(question, self.name))

    def answer_and_learn(self, question: str, question_id: str, index: int) -> tuple[MethodOutput, float, float]:
        """Answer and learn one question side by side (the online loop calls this when ``self.overlap``):
        the output, the seconds until the answer was ready, and the seconds learning went on after it.

        Retrieval cannot see this question's memory: learning stores it only after its rollouts, and
        those wait in the fused batch until the answer has retrieved and reached its own decode."""
        t0 = time.perf_counter()
        answered: list[float] = []

        def answer() -> MethodOutput:
            out = self.answer(question, index)
            answered.append(time.perf_counter() - t0)
            return out

        # learning first: the heavier part (rollouts, then the forward/backward) keeps the calling thread
        ticket, output = self.fused.run([lambda: self.elm.learner.submit(question, self.name), answer])
        self._note_ticket(output, ticket)
        output.extra["overlap"] = True  # the record's "learn" seconds are those after the answer
        return output, answered[0], time.perf_counter() - t0 - answered[0]

    def _note_ticket(self, output: MethodOutput, ticket: Any) -> None:
        output.extra["learn_job"] = ticket_summary(ticket)
        if ticket.memory_id:
            output.extra["learned_votes"] = self._votes_of(ticket.memory_id)
        if ticket.status not in ("done", "skipped"):
            output.warnings.append(f"learning the memory ended with status {ticket.status!r}")

    def record_ground_truth(self, output: MethodOutput, correct: bool) -> None:
        """Count the graded answer (right/wrong against the gold) for the memory it used, after scoring:
        the method still never sees the gold before answering and learning. A failure is a warning."""
        store = self.elm.retriever.store if self.elm.retriever is not None else None
        # the counters belong to MemoryStoreBase; a store with only the primitives keeps none
        if not output.memory_id or not isinstance(store, MemoryStoreBase):
            return
        try:
            store.record_ground_truth(self.name, output.memory_id, bool(correct))
        except Exception as exc:  # a counter must not stop an evaluation run
            output.warnings.append(f"could not record ground truth for memory {output.memory_id[:8]}: {exc}")

    def pool_stats(self) -> tuple[int, int]:
        """(memories, bytes): a memory's bytes are its serialised form, which is what a store keeps
        (the Chroma store's blob is exactly ``memory.to_bytes()``); each memory is read once."""
        retriever = self.elm.retriever
        if retriever is None:  # not built: the method refuses store.kind none
            return 0, 0
        records = retriever.store.list(self.name, kind=retriever.kind)
        size = 0
        for r in records:
            if r.id not in self._bytes:
                try:
                    self._bytes[r.id] = len(retriever.store.load(r).to_bytes())
                except ELMError:  # missing or unreadable: it takes no space (`elm memories check` reports it)
                    continue
            size += self._bytes[r.id]
        return len(records), size

    def close(self) -> None:
        self.elm.close()  # the backend belongs to the runtime, so only the learner stops here

    def abandon(self) -> None:
        """The run was interrupted: stop the learner without running its queued jobs (an interrupted job
        went back to pending; the resume forgets it and learns its question again)."""
        self.elm.close(wait=False)


def elm_input(runtime: EvalRuntime) -> ELMMethod:
    return ELMMethod(runtime, key="input", name="elm_input")


def elm_kv(runtime: EvalRuntime) -> ELMMethod:
    return ELMMethod(runtime, key="kv", name="elm_kv")


def elm_kv_centered(runtime: EvalRuntime) -> ELMMethod:
    return ELMMethod(runtime, key="kv_centered", name="elm_kv_centered")


def elm_untrained(runtime: EvalRuntime) -> ELMMethod:
    """``elm_input`` whose memories are their initial soft prompts (S = 0): the same retrieval, route and
    verifier, so its difference to ``elm_input`` is what training adds."""
    return ELMMethod(runtime, key="input", name="elm_untrained", steps=0)
