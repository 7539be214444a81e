"""The ELM graph's nodes with a stream memory (``stream.mode`` ``stream`` or ``both``).

Same wiring and node names as the per-question graph::

    retrieve -> dual_generate -> route -> verify -> respond -> learn_memory

- ``dual_generate`` draws, in one batched call, zero-shot's greedy answer, the stream memory's greedy answer
  and the ``consistency`` verifier's k seeded samples *under the stream memory* (on-policy; with
  ``learn_from: zero_shot``, without it), plus the retrieved memory's answer in ``both`` mode;
- ``verify`` (route ``vote``) returns the vote of the stream memory's greedy answer and the samples (``both``:
  with the retrieved memory's answer as one more vote): self-consistency's compute, with the memory in it;
- ``learn_memory`` updates the stream memory once from those generations, labelled by that vote (no decode of
  its own; with ``zero_shot``, from zero-shot's rows and their own vote, below), and in ``both`` mode also
  submits the per-question job.

With ``stream.clusters`` > 1 the question's retrieval key picks (or opens) a cluster of the namespace, and that
cluster's stream memory answers and learns (:mod:`elm_memory.retrieval.stream_clusters`).

Zero-shot's greedy answer is kept beside them: the collapse guard compares the memory's unboxed share with it.

With ``stream.learn_from: zero_shot`` the samples are drawn without the memory; the vote is still the memory's
greedy answer among them, but the memory learns from zero-shot's greedy answer and the samples, labelled by
their own vote (self-consistency's), so its label cannot drift with it; the guard watches its greedy answer.
"""

from __future__ import annotations

import time
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.runtime import Runtime

from elm_memory.answers import equivalent, extract_answer
from elm_memory.answers.vote import plurality_vote
from elm_memory.backends.base import GenerateRequest, generate_requests
from elm_memory.errors import ConfigError
from elm_memory.graph.context import ELMRunContext
from elm_memory.graph.nodes import ELMNodes, _elapsed, _warning, answer_params, candidate_state
from elm_memory.graph.routing import VOTE
from elm_memory.graph.state import ELMState
from elm_memory.retrieval.stream_clusters import StreamClusters, cluster_namespace
from elm_memory.store.stream_files import stream_root
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_samples import Generated, answer_budget_samples
from elm_memory.verifiers.base import SamplingVerifier
from elm_memory.verifiers.consistency import agreement_scores

#: The route a stream-memory answer reports (the vote of its own generations).
STREAM_KIND = "stream"


class StreamNodes(ELMNodes):
    """:class:`ELMNodes` with the stream memory answering and learning."""

    def retrieve(self, state: ELMState, runtime: Runtime[ELMRunContext], config: RunnableConfig) -> dict[str, Any]:
        update = super().retrieve(state, runtime, config)
        if self.services.config.stream.mode == "stream":  # per-question memories are not used in this mode
            update.update(memory_id=None, similarity=None, gate=None)
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
        version, at = stream.version, prompt.memory_at
        rows += stream.serve([prompt.zero_shot()], at)  # the serving version's greedy answer
        kinds.append(STREAM_KIND)
        params = answer_params(cfg, prompt, svc.backend.info.max_context)
        samples, sample_params = answer_budget_samples(self._sampler(), question, prompt, params)
        if cfg.stream.learn_from == "own":  # on-policy: the samples the memory learns from are its own
            samples = stream.serve(samples, at)
        requests: list[GenerateRequest] = [(rows, params), (samples, sample_params)]
        greedy_groups, sample_groups = generate_requests(svc.backend, requests)
        greedy = [gens[0] for gens in greedy_groups]
        drawn = [g for gens in sample_groups for g in gens]
        candidates = [candidate_state(kind, gen) for kind, gen in zip(kinds, greedy, strict=True)]
        answers = [extract_answer(g.text) for g in drawn]
        return {
            "candidates": candidates,
            "memory_id": memory_id,
            "presampled_answers": answers,
            "presampled_responses": [g.text for g in drawn],
            "stream": {
                "namespace": stream_namespace,
                "cluster": cluster,
                "version": version,
                "samples": [{"token_ids": list(g.token_ids), "answer": a} for g, a in zip(drawn, answers, strict=True)],
            },
            "warnings": warnings,
            "timings": _elapsed("dual_generate", t0),
        }

    def _stream_namespace(self, question: str, namespace: str, learn: bool) -> tuple[str, dict[str, Any] | None]:
        """The stream memory that answers ``question``: the namespace's, or with ``stream.clusters`` > 1 its
        cluster's (the question's retrieval key joins, or opens, a cluster; only read when nothing learns)."""
        cfg = self.services.config
        if cfg.stream.clusters == 1:
            return namespace, None
        retriever = self.services.retriever
        if retriever is None:
            raise ConfigError(
                f"stream.clusters={cfg.stream.clusters} groups questions by their retrieval keys, but these "
                "services have no retriever: set a store.kind, or stream.clusters=1"
            )
        clusters = StreamClusters(
            stream_root(cfg.store.path),
            namespace,
            max_clusters=cfg.stream.clusters,
            min_similarity=cfg.stream.cluster_min_similarity,
        )
        index, similarity = clusters.assign(retriever.query_key(question), update=learn)
        return cluster_namespace(namespace, index), {"index": index, "similarity": similarity}

    def route(self, state: ELMState) -> dict[str, Any]:
        return {"route": VOTE, "timings": _elapsed("route", time.perf_counter())}

    def vote(self, state: ELMState) -> dict[str, Any]:
        """The stream memory's greedy answer and the samples (``both``: and the retrieved memory's answer)."""
        t0 = time.perf_counter()
        candidates: list[dict[str, Any]] = [dict(c) for c in state["candidates"]]
        mine = next(c for c in candidates if c["kind"] == STREAM_KIND)
        memory = next((c for c in candidates if c["kind"] == "memory"), None)
        samples = list(state.get("presampled_answers") or [])
        texts = list(state.get("presampled_responses") or [])
        votes: list[str | None] = samples + ([memory["answer"]] if memory is not None else [])
        winner = plurality_vote(votes, mine["answer"], with_greedy=True)
        scores = agreement_scores([c["answer"] for c in candidates], [mine["answer"], *votes])
        for c, score in zip(candidates, scores, strict=True):
            c["score"] = score
        voters = [(mine["answer"], mine["response"]), *zip(samples, texts, strict=True)]
        if memory is not None:
            voters.append((memory["answer"], memory["response"]))
        response = next(
            (text for answer, text in voters if winner is not None and equivalent(answer, winner)), mine["response"]
        )
        return {
            "answer": winner,
            "response": response,
            "candidates": candidates,
            "verifier_sample_answers": samples,
            "timings": _elapsed("verify", t0),
        }

    def learn_memory(self, state: ELMState) -> dict[str, Any]:
        """Update the stream memory from this question's generations (``both``: and submit the per-question job)."""
        out: dict[str, Any] = super().learn_memory(state) if self.services.config.stream.mode == "both" else {}
        svc = self.services
        info = state.get("stream") or {}
        try:
            stream = svc.stream_memory(info["namespace"])
            mine = next(c for c in state["candidates"] if c["kind"] == STREAM_KIND)
            zero = state["candidates"][0]
            drawn = [Generated(s["token_ids"], s["answer"], sampled=True) for s in info["samples"]]
            if svc.config.stream.learn_from == "own":
                generations = [Generated(mine["token_ids"], mine["answer"], sampled=False), *drawn]
                label, served = state.get("answer"), None
            else:  # zero-shot's rows and their vote (self-consistency's); the guard watches the memory's answer
                generations = [Generated(zero["token_ids"], zero["answer"], sampled=False), *drawn]
                label = plurality_vote([g.answer for g in drawn], zero["answer"], with_greedy=True)
                served = [mine["answer"]]
            prompt = svc.prompts.answer_prompt(state["question"], memory_tokens=svc.config.memory.num_tokens)
            update = stream.learn(
                state["question"],
                prompt.token_ids,
                prompt.memory_at,
                generations,
                label=label,
                version_used=info["version"],
                zero_shot_answer=zero["answer"],
                served_answers=served,
            )
            out["stream_update"] = {**update.to_dict(), "namespace": info["namespace"], "cluster": info.get("cluster")}
        except Exception as exc:  # the answer is out already: a failed update is a warning, the last version serves
            out["warnings"] = [*out.get("warnings", []), *_warning(f"stream memory update failed: {exc}")]
        return out


def stream_memories(config: Any, loaded: Any, backend: Any = None) -> Any:
    """A per-process provider of stream memories, one per namespace (built on first use); ``backend`` draws
    replay's fresh samples (``stream.replay_samples``)."""
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
