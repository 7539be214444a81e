"""The ELM graph's nodes. Each reads the state, uses the live parts bound at build time
(:class:`~elm_memory.graph.services.ELMServices`) and the run's JSON context, and returns
only the keys it changes (``warnings`` and ``timings`` are reduced: a node returns its own).

Failure policy: a store/retriever or verifier failure never fails the request; the node
degrades to the zero-shot answer and records a warning in the trace. Bad input (an empty
question, a namespace template without its variable) fails the run with a typed error.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.runtime import Runtime

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import GenerateRequest, PromptInput, SamplingParams, answer_budget, generate_requests
from elm_memory.backends.prompting import AnswerPrompt, validate_question
from elm_memory.config import ELMConfig
from elm_memory.graph.context import ELMRunContext, as_run_context, resolve_namespace
from elm_memory.graph.routing import AGREE, ANSWERED, VERIFIER, VOTE, ZERO_SHOT, memory_wins, route_of, voted_answer
from elm_memory.graph.services import ELMServices
from elm_memory.graph.state import CandidateState, ELMState, Fresh, FreshTimings
from elm_memory.jobs.records import ticket_summary
from elm_memory.verifiers.base import SamplingVerifier

log = logging.getLogger(__name__)

ServicesProvider = Callable[[], ELMServices]


def answer_params(config: ELMConfig, prompt: AnswerPrompt, max_context: int) -> SamplingParams:
    """The params of the answer path's candidates (zero-shot and with a memory): the configured generation,
    its budget cut to the context left after ``prompt`` and a memory's tokens, and the run's seed."""
    g = config.generation
    k = config.memory.num_tokens
    return SamplingParams(
        max_new_tokens=answer_budget(g.max_new_tokens, max_context, len(prompt.token_ids), k),
        temperature=g.temperature,
        top_p=g.top_p,
        stop_at_answer=g.stop_at_answer,
        seed=config.training.seed,
    )


def candidate_state(kind: str, gen: Any) -> CandidateState:
    """One greedy candidate of the answer path, as the graph's state keeps it (not yet scored)."""
    return CandidateState(
        kind=kind,
        answer=extract_answer(gen.text),
        response=gen.text,
        token_ids=list(gen.token_ids),
        finish_reason=gen.finish_reason,
        score=None,
    )


def _elapsed(name: str, t0: float) -> dict[str, float]:
    return {name: time.perf_counter() - t0}


def _warning(message: str) -> list[str]:
    log.warning(message)
    return [message]


class ELMNodes:
    """The nodes, bound to one process's services (``services`` may build them on first use). ``config`` (or a
    cheap callable returning it): the services' config, readable before they are built (see :attr:`config`)."""

    def __init__(
        self, services: ELMServices | ServicesProvider, config: ELMConfig | Callable[[], ELMConfig] | None = None
    ):
        self._services: ServicesProvider = services if callable(services) else (lambda: services)
        self._config = config

    @property
    def services(self) -> ELMServices:
        return self._services()

    @property
    def config(self) -> ELMConfig:
        """The config, without building the services when it was given: a served graph builds its model on its
        first run, and a run's context keys and the mode are checked before that."""
        if self._config is None:
            return self.services.config
        return self._config() if callable(self._config) else self._config

    # -- retrieve ------------------------------------------------------------------------
    def retrieve(self, state: ELMState, runtime: Runtime[ELMRunContext], config: RunnableConfig) -> dict[str, Any]:
        """Top-1 memory of the run's namespace, or none (empty pool, a gate, a failure)."""
        t0 = time.perf_counter()
        question = validate_question(state["question"])
        # strict (unknown keys refused) when this graph is the one being run; inside a parent graph the
        # context is the parent's, of its own schema: ELM reads its keys and ignores the others
        context = as_run_context(runtime.context, config=config, template=self.config.namespace_template)
        svc = self.services
        namespace = resolve_namespace(
            state.get("namespace"),
            context,
            (config or {}).get("configurable"),
            template=svc.config.namespace_template,
            default=svc.config.namespace,
        )
        learn = state.get("learn")
        if learn is None:
            learn = context.learn if context is not None and context.learn is not None else True
        update: dict[str, Any] = {
            "question": question,
            "namespace": namespace,
            "learn": bool(learn),
            "memory_id": None,
            "similarity": None,
            "gate": None,
            "learn_job": None,
            "stream_update": None,  # a thread's next run (learn=False, say) must not report this one's update
            "warnings": Fresh(),
        }
        if svc.retriever is not None:
            r = svc.config.retrieval
            try:
                hits, decision = svc.retriever.retrieve_with_gates(
                    question,
                    namespace,
                    k=r.top_k,
                    min_similarity=r.min_similarity,
                    skip_no_consensus=r.skip_no_consensus,
                    min_majority_share=r.min_majority_share,
                )
                update["gate"] = decision.to_dict()
            except Exception as exc:  # degrade, never fail the answer
                update["warnings"] = Fresh(_warning(f"retrieval failed, answering zero-shot: {exc}"))
                hits = []
            if hits:
                svc.memories.put(hits[0].memory)
                update["memory_id"], update["similarity"] = hits[0].memory.id, float(hits[0].score)
        update["timings"] = FreshTimings(_elapsed("retrieve", t0))
        return update

    # -- dual_generate -------------------------------------------------------------------
    def dual_generate(self, state: ELMState) -> dict[str, Any]:
        """Zero-shot and memory-conditioned answers in ONE batched backend call (greedy by default)."""
        t0 = time.perf_counter()
        svc = self.services
        cfg = svc.config
        k = cfg.memory.num_tokens
        prompt = svc.prompts.answer_prompt(state["question"], memory_tokens=k)
        inputs, kinds, memory_id, warnings = self._candidate_rows(prompt, state.get("memory_id"))
        params = answer_params(cfg, prompt, svc.backend.info.max_context)
        requests: list[GenerateRequest] = [(inputs, params)]
        # no memory: nothing to route, unless the vote counts the samples on every question
        sampler = self._presampler() if len(inputs) > 1 or self._votes() else None
        if sampler is not None:
            sample_prompts, sample_params = sampler.sample_request(state["question"], inputs[0])
            # no longer than the answers' budget: a batch the answers would cut short can run a bit longer,
            # never past what the answers alone may take
            budget = min(sample_params.max_new_tokens, params.max_new_tokens)
            requests.append((sample_prompts, dataclasses.replace(sample_params, max_new_tokens=budget)))
        generated = generate_requests(svc.backend, requests)
        results = generated[0]
        drawn, samples = None, None
        if sampler is not None:
            drawn = [g for gens in generated[1] for g in gens]
            samples = sampler.sample_answers_of(drawn)
        candidates = [candidate_state(kind, gen) for kind, [gen] in zip(kinds, results, strict=True)]
        return {
            "candidates": candidates,
            "memory_id": memory_id,
            "presampled_answers": samples,
            # the vote may pick a sample's answer: its text is then the response
            "presampled_responses": [g.text for g in drawn] if drawn is not None and self._votes() else None,
            "warnings": warnings,
            "timings": _elapsed("dual_generate", t0),
        }

    def _candidate_rows(
        self, prompt: AnswerPrompt, memory_id: str | None
    ) -> tuple[list[PromptInput], list[str], str | None, list[str]]:
        """The candidates' prompts and kinds: zero-shot, and the retrieved memory's when it can be used (else a
        warning, and no memory id)."""
        svc = self.services
        inputs, kinds, warnings = [prompt.zero_shot()], ["zero_shot"], []
        if memory_id:
            try:
                memory = svc.memory(memory_id)
                memory.check_compatible(svc.backend.info)
                inputs.append(prompt.for_memory(memory))
                kinds.append("memory")
            except Exception as exc:
                warnings += _warning(f"memory {memory_id[:8]} unusable, answering without it: {exc}")
                memory_id = None
        return inputs, kinds, memory_id, warnings

    def _presampler(self) -> SamplingVerifier | None:
        """The verifier, when it asks for its samples ahead and the backend decodes several calls as one
        batch (elsewhere drawing them ahead would cost a decode on every question, agreeing or not)."""
        svc = self.services
        verifier = svc.verifier
        if not (isinstance(verifier, SamplingVerifier) and verifier.presample):
            return None
        return verifier if getattr(svc.backend, "batches_calls", False) else None

    def _votes(self) -> bool:
        """``verifier.route=vote`` with a verifier that draws samples to vote on."""
        svc = self.services
        return svc.config.verifier.route == VOTE and isinstance(svc.verifier, SamplingVerifier)

    # -- route / verify ------------------------------------------------------------------
    def route(self, state: ELMState) -> dict[str, Any]:
        """``verifier.route=vote``: always the vote (in ``verify``). Otherwise one candidate: zero-shot.
        Agreeing answers: they win. Only one answered (if configured): it wins. Else the verifier decides."""
        t0 = time.perf_counter()
        candidates = state["candidates"]
        zero = candidates[0]
        memory = candidates[1] if len(candidates) > 1 else None
        warnings: list[str] = []
        votes = self._votes()
        if self.services.config.verifier.route == VOTE and not votes:
            warnings += _warning("verifier.route=vote needs a verifier that draws samples; routing as verify")
        route = route_of(
            zero["answer"],
            memory["answer"] if memory is not None else None,
            has_memory=memory is not None,
            prefer_answered=self.services.config.verifier.prefer_answered,
            vote=votes,
        )
        decided: dict[str, Any] = {"route": route, "warnings": warnings}
        if route in (ZERO_SHOT, AGREE):
            decided.update(answer=zero["answer"], response=zero["response"])
        elif route == ANSWERED:
            answered = zero if zero["answer"] is not None else memory
            assert answered is not None  # route_of says exactly one answered
            decided.update(answer=answered["answer"], response=answered["response"])
        return {**decided, "timings": _elapsed("route", t0)}

    def verify(self, state: ELMState) -> dict[str, Any]:
        """Score both candidates; the memory's answer wins only with a strictly higher score."""
        if state.get("route") == VOTE:
            return self.vote(state)
        t0 = time.perf_counter()
        svc = self.services
        candidates: list[dict[str, Any]] = [dict(c) for c in state["candidates"]]
        chosen = candidates[0]
        warnings: list[str] = []
        update: dict[str, Any] = {}
        if svc.verifier is None:
            warnings += _warning("answers disagree and no verifier is configured: keeping zero-shot")
        else:
            try:
                from elm_memory.verifiers.base import Candidate

                # the zero-shot prompt of dual_generate: the verifier judges answers to the question itself
                plain = svc.prompts.answer_prompt(state["question"], memory_tokens=svc.config.memory.num_tokens)
                scored = [
                    Candidate(
                        text=c["response"], token_ids=tuple(c["token_ids"]), prompt=plain.zero_shot(), kind=c["kind"]
                    )
                    for c in candidates
                ]
                if isinstance(svc.verifier, SamplingVerifier):
                    # the samples drawn ahead, if any, plus what the verifier draws now (a tie's more):
                    # the trace keeps the count, the verifier's cost on this question
                    answers = [c["answer"] for c in candidates]
                    ahead = state.get("presampled_answers")
                    used = svc.verifier.samples_to_score(state["question"], answers, ahead, scored)
                    scores = svc.verifier.score_with_samples(answers, used)
                    update["verifier_sample_answers"] = used
                else:
                    scores = svc.verifier.score(state["question"], scored)
                for c, s in zip(candidates, scores, strict=True):
                    c["score"] = _json_float(s)
                if memory_wins(scores):
                    chosen = candidates[1]
            except Exception as exc:
                warnings += _warning(f"verifier failed, keeping zero-shot: {exc}")
        return {
            **update,
            "answer": chosen["answer"],
            "response": chosen["response"],
            "candidates": candidates,
            "warnings": warnings,
            "timings": _elapsed("verify", t0),
        }

    def vote(self, state: ELMState) -> dict[str, Any]:
        """The majority of zero-shot, the k samples and the memory (:func:`voted_answer`). The response is
        the text of the first of them that gave the winning answer; each candidate's score is its share of
        the samples, as the verifier would score it."""
        t0 = time.perf_counter()
        svc = self.services
        verifier = svc.verifier
        assert isinstance(verifier, SamplingVerifier)  # route() votes only with one
        candidates: list[dict[str, Any]] = [dict(c) for c in state["candidates"]]
        samples, texts = state.get("presampled_answers"), state.get("presampled_responses")
        try:
            if samples is None or texts is None:  # not drawn with the candidates: draw them now
                plain = svc.prompts.answer_prompt(state["question"], memory_tokens=svc.config.memory.num_tokens)
                prompts, params = verifier.sample_request(state["question"], plain.zero_shot())
                drawn = [g for gens in svc.backend.generate(prompts, params) for g in gens]
                samples, texts = verifier.sample_answers_of(drawn), [g.text for g in drawn]
        except Exception as exc:
            zero = candidates[0]
            return {
                "answer": zero["answer"],
                "response": zero["response"],
                "warnings": _warning(f"sampling for the vote failed, keeping zero-shot: {exc}"),
                "timings": _elapsed("verify", t0),
            }
        answers = [c["answer"] for c in candidates]
        winner = voted_answer(answers[0], samples, answers[1] if len(answers) > 1 else None)
        for c, score in zip(candidates, verifier.score_with_samples(answers, samples), strict=True):
            c["score"] = _json_float(score)
        voters = [*((c["answer"], c["response"]) for c in candidates), *zip(samples, texts, strict=True)]
        response = next(
            (text for answer, text in voters if winner is not None and equivalent(answer, winner)),
            candidates[0]["response"],  # no answer anywhere: zero-shot's text
        )
        return {
            "answer": winner,
            "response": response,
            "candidates": candidates,
            "verifier_sample_answers": list(samples),
            "timings": _elapsed("verify", t0),
        }

    # -- respond / learn -----------------------------------------------------------------
    def respond(self, state: ELMState) -> dict[str, Any]:
        """Close the trace: total time of the answer path (learning is not part of it), and count what
        the route did with the memory used (its utility; a failure there is only a warning)."""
        timings = state.get("timings") or {}
        total = sum(v for k, v in timings.items() if k in ANSWER_PATH)
        return {"timings": {"total": total}, "warnings": self._record_outcome(state)}

    def _record_outcome(self, state: ELMState) -> list[str]:
        svc = self.services
        memory_id, candidates = state.get("memory_id"), state.get("candidates") or []
        record = svc.retriever.store.record_outcome if svc.retriever is not None else None
        if not memory_id or len(candidates) < 2 or record is None:
            return []
        zero, mem = candidates[0], candidates[1]
        route = state.get("route")
        if route == AGREE or (route == VOTE and equivalent(zero.get("answer"), mem.get("answer"))):
            outcome = "agree"
        elif route == "answered":  # exactly one candidate has an answer: it was chosen
            outcome = "won" if mem.get("answer") is not None else "lost"
        elif state.get("response") == mem.get("response") != zero.get("response"):
            outcome = "won"
        elif svc.verifier is not None and any(c.get("score") is not None for c in (zero, mem)):
            outcome = "lost"
        else:  # no verifier, or it failed: zero-shot was kept by default, not judged better
            outcome = "unjudged"
        try:
            record(state["namespace"], memory_id, outcome, state.get("similarity"))
        except Exception as exc:  # never fail the answer over a counter
            return _warning(f"could not record the outcome of memory {memory_id[:8]}: {exc}")
        return []

    def learn_memory(self, state: ELMState) -> dict[str, Any]:
        """Hand the question to the memory learner and return at once (sync mode waits: paper protocol)."""
        svc = self.services
        if svc.learner is None:
            return {"learn_job": None}
        try:
            ticket = svc.learner.submit(state["question"], state["namespace"])
        except Exception as exc:
            return {"learn_job": None, "warnings": _warning(f"could not submit the learning job: {exc}")}
        return {"learn_job": ticket_summary(ticket)}  # reused: the question was learned before (no new memory)


ANSWER_PATH = ("retrieve", "dual_generate", "route", "verify")


def after_route(state: ELMState) -> str:
    return "verify" if state.get("route") in (VERIFIER, VOTE) else "respond"


def after_respond(state: ELMState) -> str:
    return "learn_memory" if state.get("learn", True) else "__end__"


def _json_float(x: float) -> float | None:
    """-inf (empty response) is not JSON; None keeps the trace serialisable."""
    return None if x != x or x in (float("inf"), float("-inf")) else float(x)
