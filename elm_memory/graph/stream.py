"""The ELM graph's nodes with a stream memory (``stream.mode`` ``stream`` or ``both``).

Same wiring and node names as the per-question graph::

    retrieve -> dual_generate -> route -> verify -> respond -> learn_memory

Each node runs one phase of the question's :class:`~elm_memory.graph.stream_turn.StreamTurn` (which rows to draw,
what to answer, what to learn), the object the evaluation runs too; the turn travels between the nodes as JSON in
the state's ``stream`` key:

- ``dual_generate`` plans the turn (``stream.serving`` and the gate's state decide the rows) and draws its rows in
  one batched call (and, when a serving memory gave no boxed answer, the vote's rows in a second);
- ``route`` returns the memory's answer when it answers alone (route ``stream``), else routes to the vote;
- ``verify`` (route ``vote``) returns the turn's vote;
- ``learn_memory`` updates the stream memory from the turn's spent rows (and, in ``both`` mode, submits the
  per-question job).

With ``stream.tuning.clusters`` > 1 the question's retrieval key picks (or opens) a cluster of the namespace, and that
cluster's stream memory answers and learns (:mod:`elm_memory.retrieval.stream_clusters`).
"""

from __future__ import annotations

import time
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.runtime import Runtime

from elm_memory.backends.base import generate_requests
from elm_memory.errors import ConfigError
from elm_memory.graph.context import ELMRunContext
from elm_memory.graph.nodes import ELMNodes, _elapsed, _warning, answer_params
from elm_memory.graph.routing import VOTE
from elm_memory.graph.state import CandidateState, ELMState
from elm_memory.graph.stream_turn import MEMORY, MEMORY_PROBE, RETRIEVED, STREAM, ZERO_SHOT, StreamTurn
from elm_memory.retrieval.stream_clusters import StreamClusters, cluster_namespace
from elm_memory.store.stream_files import stream_root
from elm_memory.training.stream import StreamMemory
from elm_memory.verifiers.base import SamplingVerifier
from elm_memory.verifiers.consistency import agreement_scores

#: The route of an answer the stream memory's greedy answer gave alone (``stream.serving: amortized``, gate open),
#: and the kind of its candidate.
STREAM_KIND = "stream"


class StreamNodes(ELMNodes):
    """:class:`ELMNodes` with the stream memory answering and learning, through :class:`StreamTurn`."""

    def retrieve(self, state: ELMState, runtime: Runtime[ELMRunContext], config: RunnableConfig) -> dict[str, Any]:
        update = super().retrieve(state, runtime, config)
        if self.services.config.stream.mode == "stream":  # per-question memories are not used in this mode
            update.update(memory_id=None, similarity=None, gate=None)
        update["stream_turn"] = None
        return update

    def _sampler(self) -> SamplingVerifier:
        verifier = self.services.verifier
        if not isinstance(verifier, SamplingVerifier):
            raise ConfigError(
                f"stream.mode={self.services.config.stream.mode} votes on the consistency verifier's samples; "
                f"verifier.name={self.services.config.verifier.name} draws none: set verifier.name=consistency"
            )
        return verifier

    def dual_generate(self, state: ELMState) -> dict[str, Any]:
        t0 = time.perf_counter()
        svc = self.services
        cfg = svc.config
        question = state["question"]
        stream_namespace, cluster = self._stream_namespace(question, state["namespace"], bool(state.get("learn", True)))
        stream = svc.stream_memory(stream_namespace)
        prompt = svc.prompts.answer_prompt(question, memory_tokens=cfg.memory.num_tokens)
        rows, kinds, memory_id, warnings = self._candidate_rows(prompt, state.get("memory_id"))
        params = answer_params(cfg, prompt, svc.backend.info.max_context)
        sampler = self._sampler()
        turn = StreamTurn.plan(cfg, stream, question, stream_namespace)
        requests, greedy = turn.requests(cfg, stream, prompt, params, sampler, extra=rows[1:])
        turn.read(generate_requests(svc.backend, requests), greedy)
        if turn.needs_fallback:
            warnings += _warning("the stream memory's answer has no \\boxed{}: answering by the vote")
            turn.read_fallback(generate_requests(svc.backend, turn.fallback_requests(prompt, params, sampler)))
        order = [ZERO_SHOT, RETRIEVED, STREAM]
        candidates = [
            CandidateState(
                kind=name,
                answer=row.answer,
                response=row.text,
                token_ids=list(row.token_ids),
                finish_reason=row.finish_reason,
                score=None,
            )
            for name in order
            if (row := turn.rows.get(name)) is not None and row.spent
        ]
        spent = [s for s in turn.samples if s.spent]
        return {
            "candidates": candidates,
            "memory_id": memory_id if RETRIEVED in turn.rows else None,
            "presampled_answers": [s.answer for s in spent] if spent else None,
            "presampled_responses": [s.text for s in spent] if spent else None,
            "stream": {"namespace": stream_namespace, "cluster": cluster, "turn": turn.to_state()},
            "stream_turn": turn.summary(),
            "warnings": warnings,
            "timings": _elapsed("dual_generate", t0),
        }

    def _stream_namespace(self, question: str, namespace: str, learn: bool) -> tuple[str, dict[str, Any] | None]:
        """The stream memory that answers ``question``: the namespace's, or with ``stream.tuning.clusters`` > 1 its
        cluster's (the question's retrieval key joins, or opens, a cluster; only read when nothing learns)."""
        cfg = self.services.config
        if cfg.stream.tuning.clusters == 1:
            return namespace, None
        retriever = self.services.retriever
        if retriever is None:
            raise ConfigError(
                f"stream.tuning.clusters={cfg.stream.tuning.clusters} groups questions by their retrieval keys, "
                "but these "
                "services have no retriever: set a store.kind, or stream.tuning.clusters=1"
            )
        clusters = StreamClusters(
            stream_root(cfg.store.path),
            namespace,
            max_clusters=cfg.stream.tuning.clusters,
            min_similarity=cfg.stream.tuning.cluster_min_similarity,
        )
        index, similarity = clusters.assign(retriever.query_key(question), update=learn)
        return cluster_namespace(namespace, index), {"index": index, "similarity": similarity}

    def route(self, state: ELMState) -> dict[str, Any]:
        t0 = time.perf_counter()
        turn = StreamTurn.from_state((state.get("stream") or {})["turn"])
        if turn.mode in (MEMORY, MEMORY_PROBE):  # the memory's greedy answer alone
            return {"route": STREAM_KIND, "answer": turn.answer, "response": turn.response, **_timed("route", t0)}
        return {"route": VOTE, **_timed("route", t0)}

    def vote(self, state: ELMState) -> dict[str, Any]:
        """The turn's vote (serving ``vote``: the memory's greedy answer and the samples, and in ``both`` mode the
        retrieved memory's; ``amortized``: zero-shot's and the samples). Each candidate's score: its share of them."""
        t0 = time.perf_counter()
        turn = StreamTurn.from_state((state.get("stream") or {})["turn"])
        candidates: list[dict[str, Any]] = [dict(c) for c in state["candidates"]]
        samples = [s.answer for s in turn.samples if s.spent]
        greedy = turn.rows[STREAM if turn.serving == "vote" else ZERO_SHOT].answer
        extra = [turn.rows[RETRIEVED].answer] if RETRIEVED in turn.rows else []
        scores = agreement_scores([c["answer"] for c in candidates], [greedy, *samples, *extra])
        for c, score in zip(candidates, scores, strict=True):
            c["score"] = score
        return {
            "answer": turn.answer,
            "response": turn.response,
            "candidates": candidates,
            "verifier_sample_answers": samples,
            "timings": _elapsed("verify", t0),
        }

    def learn_memory(self, state: ELMState) -> dict[str, Any]:
        """Update the stream memory from this question's turn (``both``: and submit the per-question job)."""
        out: dict[str, Any] = super().learn_memory(state) if self.services.config.stream.mode == "both" else {}
        svc = self.services
        info = state.get("stream") or {}
        try:
            stream = svc.stream_memory(info["namespace"])
            turn = StreamTurn.from_state(info["turn"])
            prompt = svc.prompts.answer_prompt(state["question"], memory_tokens=svc.config.memory.num_tokens)
            update = turn.learn(svc.config, stream, prompt)
            if update is None:
                out["stream_update"] = {
                    "skipped": "not_probed",
                    "version": stream.version,
                    "namespace": info["namespace"],
                }
            else:
                out["stream_update"] = {
                    **update.to_dict(),
                    "namespace": info["namespace"],
                    "cluster": info.get("cluster"),
                }
        except Exception as exc:  # the answer is out already: a failed update is a warning, the last version serves
            out["warnings"] = [*out.get("warnings", []), *_warning(f"stream memory update failed: {exc}")]
        return out


def _timed(name: str, t0: float) -> dict[str, Any]:
    return {"timings": _elapsed(name, t0)}


def stream_memories(config: Any, loaded: Any, backend: Any = None) -> Any:
    """A per-process provider of stream memories, one per namespace (built on first use); ``backend`` draws
    replay's fresh samples (``stream.tuning.replay_samples``)."""
    import threading

    from elm_memory.store.stream_files import stream_root

    root = stream_root(config.store.path)
    cache: dict[str, StreamMemory] = {}
    lock = threading.Lock()

    def get(namespace: str) -> StreamMemory:
        with lock:
            if namespace not in cache:
                cache[namespace] = StreamMemory(config, loaded, root, namespace=namespace, backend=backend)
            return cache[namespace]

    return get
