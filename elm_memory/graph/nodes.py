"""The ELM graph's nodes. Each reads the state, uses injected dependencies from the
runtime context, and returns only the keys it changes.

Failure policy: a store/retriever or verifier failure never fails the request; the
node degrades to the zero-shot answer and records a warning in the trace.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from langgraph.runtime import Runtime

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import PromptInput, SamplingParams, answer_budget
from elm_memory.graph.context import ELMContext, resolve_context
from elm_memory.graph.state import CandidateState, ELMState
from elm_memory.models.prompting import validate_question

log = logging.getLogger(__name__)


def _timed(state: ELMState, name: str, t0: float) -> dict[str, float]:
    return {**(state.get("timings") or {}), name: time.perf_counter() - t0}


def _warn(state: ELMState, message: str) -> list[str]:
    log.warning(message)
    return [*(state.get("warnings") or []), message]


def retrieve(state: ELMState, runtime: Runtime[ELMContext]) -> dict[str, Any]:
    """Top-1 memory of the request's namespace, or none (empty pool, below threshold, failure)."""
    t0 = time.perf_counter()
    ctx = resolve_context(runtime.context)
    question = validate_question(state["question"])
    namespace = state.get("namespace") or ctx.config.namespace
    update: dict[str, Any] = {"question": question, "namespace": namespace, "memory_id": None, "similarity": None}
    if ctx.retriever is not None:
        r = ctx.config.retrieval
        try:
            hits = ctx.retriever.retrieve(
                question, namespace, k=r.top_k, min_similarity=r.min_similarity, skip_no_consensus=r.skip_no_consensus
            )
        except Exception as exc:  # degrade, never fail the answer
            update["warnings"] = _warn(state, f"retrieval failed, answering zero-shot: {exc}")
            hits = []
        if hits:
            ctx.remember(hits[0].memory)
            update["memory_id"], update["similarity"] = hits[0].memory.id, float(hits[0].score)
    update["timings"] = _timed(state, "retrieve", t0)
    return update


def dual_generate(state: ELMState, runtime: Runtime[ELMContext]) -> dict[str, Any]:
    """Zero-shot and memory-conditioned answers in ONE batched backend call (greedy by default)."""
    t0 = time.perf_counter()
    ctx = resolve_context(runtime.context)
    cfg = ctx.config
    k = cfg.memory.num_tokens
    built = ctx.prompts.build(state["question"], reserve=k + 1)
    inputs = [PromptInput(built.token_ids)]
    kinds = ["zero_shot"]
    warnings = state.get("warnings") or []
    memory_id = state.get("memory_id")
    if memory_id:
        try:
            memory = ctx.memory(memory_id)
            memory.check_compatible(ctx.backend.info)
            at = built.memory_position(cfg.prompt.soft_prompt_position)
            inputs.append(PromptInput(built.token_ids, soft_prompt=memory.soft_prompt, soft_prompt_at=at))
            kinds.append("memory")
        except Exception as exc:
            warnings = _warn(state, f"memory {memory_id[:8]} unusable, answering zero-shot: {exc}")
            memory_id = None
    g = cfg.generation
    params = SamplingParams(
        max_new_tokens=answer_budget(g.max_new_tokens, ctx.backend.info.max_context, len(built.token_ids), k),
        temperature=g.temperature,
        top_p=g.top_p,
        stop_at_answer=g.stop_at_answer,
        seed=cfg.training.seed,
    )
    results = ctx.backend.generate(inputs, params)
    candidates: list[CandidateState] = []
    for kind, [gen] in zip(kinds, results, strict=True):
        candidates.append(
            CandidateState(
                kind=kind,
                answer=extract_answer(gen.text),
                response=gen.text,
                token_ids=list(gen.token_ids),
                finish_reason=gen.finish_reason,
                score=None,
            )
        )
    return {
        "candidates": candidates,
        "memory_id": memory_id,
        "warnings": warnings,
        "timings": _timed(state, "dual_generate", t0),
    }


def route(state: ELMState, runtime: Runtime[ELMContext]) -> dict[str, Any]:
    """Agreeing answers win outright; otherwise the verifier's higher score (ties: zero-shot)."""
    t0 = time.perf_counter()
    ctx = resolve_context(runtime.context)
    candidates = [dict(c) for c in state["candidates"]]
    zero = candidates[0]
    if len(candidates) == 1:
        return {"route": "zero_shot", "answer": zero["answer"], "response": zero["response"],
                "timings": _timed(state, "route", t0)}  # fmt: skip
    memory = candidates[1]
    if equivalent(zero["answer"], memory["answer"]):
        return {"route": "agree", "answer": zero["answer"], "response": zero["response"],
                "timings": _timed(state, "route", t0)}  # fmt: skip
    warnings = state.get("warnings") or []
    chosen = zero
    if ctx.verifier is None:
        warnings = _warn(state, "answers disagree and no verifier is configured: keeping zero-shot")
    else:
        try:
            from elm_memory.verifiers.base import Candidate

            built = ctx.prompts.build(state["question"])
            scored = [
                Candidate(text=c["response"], token_ids=tuple(c["token_ids"]), prompt=PromptInput(built.token_ids),
                          kind=c["kind"])  # fmt: skip
                for c in candidates
            ]
            scores = ctx.verifier.score(state["question"], scored)
            for c, s in zip(candidates, scores, strict=True):
                c["score"] = _json_float(s)
            if scores[1] > scores[0]:
                chosen = memory
        except Exception as exc:
            warnings = _warn(state, f"verifier failed, keeping zero-shot: {exc}")
    return {
        "route": "verifier",
        "answer": chosen["answer"],
        "response": chosen["response"],
        "candidates": candidates,
        "warnings": warnings,
        "timings": _timed(state, "route", t0),
    }


def respond(state: ELMState) -> dict[str, Any]:
    """Close the trace: total time of the answer path (learning is not part of it)."""
    timings = dict(state.get("timings") or {})
    timings["total"] = sum(v for k, v in timings.items() if k in ("retrieve", "dual_generate", "route"))
    return {"timings": timings, "warnings": state.get("warnings") or []}


def learn_memory(state: ELMState, runtime: Runtime[ELMContext]) -> dict[str, Any]:
    """Hand the question to the memory learner and return at once (sync mode waits: paper protocol)."""
    ctx = resolve_context(runtime.context)
    if ctx.learner is None or not state.get("learn", True):
        return {"learn_job": None}
    try:
        ticket = ctx.learner.submit(state["question"], state.get("namespace") or ctx.config.namespace)
    except Exception as exc:
        return {"learn_job": None, "warnings": _warn(state, f"could not submit the learning job: {exc}")}
    return {"learn_job": {"job_id": ticket.job_id, "status": ticket.status, "memory_id": ticket.memory_id}}


def should_learn(state: ELMState) -> str:
    return "learn_memory" if state.get("learn", True) else "__end__"


def _json_float(x: float) -> float | None:
    """-inf (empty response) is not JSON; None keeps the trace serialisable."""
    return None if x != x or x in (float("inf"), float("-inf")) else float(x)
