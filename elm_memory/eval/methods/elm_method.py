"""ELM in the online protocol: answer through the ELM graph, then learn a memory (sync).

Each ELM method keeps its pool in ``<out>/store`` under its own namespace (its name), so
``elm_input`` and ``elm_kv`` in one run never see each other's memories, and a resumed run
finds the pool it left. The learner's job ids are derived from (model, namespace,
question): re-submitting a question whose memory exists after a crash is a no-op.
"""

from __future__ import annotations

from elm_memory.elm import ELM
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput


class ELMMethod:
    def __init__(self, runtime: EvalRuntime, key: str, name: str):
        self.name = name
        self.runtime = runtime
        cfg = runtime.config
        store_dir = runtime.out_dir / "store"
        self.config = cfg.model_copy(
            update={
                "namespace": name,
                "retrieval": cfg.retrieval.model_copy(update={"key": key}),
                "store": cfg.store.model_copy(update={"kind": "chroma", "path": str(store_dir)}),
                "learner": cfg.learner.model_copy(
                    update={"mode": "sync", "queue_path": str(store_dir / f"learner-{name}.sqlite3")}
                ),
            }
        )
        base = runtime.base
        self.elm = ELM(self.config, loaded=base.loaded, backend=base.backend, verifier=base.verifier)

    def answer(self, question: str, index: int) -> MethodOutput:
        r = self.elm.answer(question, namespace=self.name, learn=False)
        return MethodOutput(
            answer=r.answer,
            response=r.response,
            route=r.route,
            memory_id=r.memory_id,
            similarity=r.similarity,
            candidates=[{"kind": c.get("kind"), "answer": c.get("answer"), "score": c.get("score")}
                        for c in r.candidates],  # fmt: skip
            warnings=r.warnings,
            extra={"gate": r.gate} if r.gate is not None else {},
        )

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        ticket = self.elm.learner.submit(question, self.name)
        output.extra["learn_job"] = {"job_id": ticket.job_id, "status": ticket.status, "memory_id": ticket.memory_id}
        if ticket.status not in ("done", "skipped"):
            output.warnings.append(f"learning the memory ended with status {ticket.status!r}")

    def record_ground_truth(self, output: MethodOutput, correct: bool) -> None:
        """Count the graded answer (right/wrong against the gold) for the memory it used, after scoring:
        the method still never sees the gold before answering and learning. A failure is a warning."""
        if not output.memory_id or self.elm.retriever is None:
            return
        record = getattr(self.elm.retriever.store, "record_ground_truth", None)
        if record is None:
            return
        try:
            record(self.name, output.memory_id, bool(correct))
        except Exception as exc:  # a counter must not stop an evaluation run
            output.warnings.append(f"could not record ground truth for memory {output.memory_id[:8]}: {exc}")

    def pool_stats(self) -> tuple[int, int]:
        retriever = self.elm.retriever
        store = retriever.store
        records = store.list(self.name, kind=retriever.kind)
        blobs = getattr(store, "blobs", None)
        size = 0
        if blobs is not None:
            for r in records:
                p = blobs.path(r.blob)
                size += p.stat().st_size if p.exists() else 0
        return len(records), size

    def close(self) -> None:
        self.elm.close()  # the backend belongs to the runtime, so only the learner stops here


def elm_input(runtime: EvalRuntime) -> ELMMethod:
    return ELMMethod(runtime, key="input", name="elm_input")


def elm_kv(runtime: EvalRuntime) -> ELMMethod:
    return ELMMethod(runtime, key="kv", name="elm_kv")
