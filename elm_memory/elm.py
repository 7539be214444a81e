"""The ELM facade: wires config -> model, backend, prompt builder, retriever (store + keys),
verifier, learner and the graph. It holds no method logic of its own: answering is the
graph (``elm_memory.graph``), learning is ``elm_memory.training``."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from elm_memory.backends.base import GenerationBackend
from elm_memory.backends.prompting import PromptBuilder, validate_question
from elm_memory.backends.registry import backends
from elm_memory.config import ELMConfig, deep_merge
from elm_memory.errors import ConfigError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import validate_namespace
from elm_memory.models.loading import LoadedModel, load_model

if TYPE_CHECKING:  # built lazily (heavy imports), so named for the annotations only
    from elm_memory.graph import ELMServices
    from elm_memory.jobs import MemoryLearner
    from elm_memory.retrieval.retriever import Retriever
    from elm_memory.training.native import StepCallback
    from elm_memory.verifiers.base import Verifier


@dataclass
class AnswerResult:
    """What ``ELM.answer`` / ``elm solve --json`` return."""

    question: str
    answer: str | None
    response: str
    route: str  # "zero_shot" | "agree" | "answered" | "verifier" | "vote"
    memory_id: str | None = None
    similarity: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    learn_job: dict[str, Any] | None = None
    namespace: str | None = None
    gate: dict[str, Any] | None = None  # why the retrieved memory was or was not used
    # answers of the samples a sampling verifier scored the disagreement on (None: no such verifier scored)
    verifier_sample_answers: list[str | None] | None = None
    # answers of the samples drawn with the candidates (presample), scored or not: what a vote would see
    presampled_answers: list[str | None] | None = None
    # stream.mode stream/both: what this question did to the stream memory (versions, label, skip or rollback)
    stream_update: dict[str, Any] | None = None
    # stream.mode stream/both: how the answer was made (mode, gate state, probe, version, tokens generated)
    stream_turn: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for c in out["candidates"]:
            c.pop("token_ids", None)  # bulky; the response text is there
        return out


class ELM:
    """Entry point for library users::

    with ELM(ELMConfig.load(preset="cpu-demo")) as elm:
        result = elm.answer("What is 17 + 25?")   # retrieve, dual-generate, route, then learn
    """

    def __init__(
        self,
        config: ELMConfig,
        *,
        loaded: LoadedModel | None = None,
        backend: GenerationBackend | None = None,
        retriever: Retriever | None = None,
        verifier: Verifier | None = None,
        learner: MemoryLearner | None = None,
    ):
        self.config = config
        self._loaded = loaded
        self._backend = backend
        self._retriever = retriever
        self._verifier = verifier
        self._learner = learner
        self._prompts: PromptBuilder | None = None
        self._graph: Any = None  # a compiled LangGraph graph
        self._services: ELMServices | None = None
        self._lock = threading.Lock()  # lazy construction from several request threads
        # the learner has its own lock: building it takes self._lock (retriever, loaded), and
        # two learners would mean two background threads on one queue
        self._learner_lock = threading.Lock()
        self._owns_backend = backend is None  # a backend we built (e.g. a vLLM engine) is ours to stop

    @classmethod
    def from_config(cls, config: ELMConfig | None = None, **load_kwargs: Any) -> ELM:
        return cls(config or ELMConfig.load(**load_kwargs))

    def __enter__(self) -> ELM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, wait: bool = True) -> None:
        """Stop the learner (``wait``: finish queued jobs first), then a backend engine we started."""
        if self._learner is not None:
            self._learner.close(wait=wait)
        if self._owns_backend and self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()

    # -- lazily built parts ----------------------------------------------------------
    @property
    def loaded(self) -> LoadedModel:
        with self._lock:
            if self._loaded is None:
                self._loaded = load_model(self.config.model)
            return self._loaded

    @property
    def backend(self) -> GenerationBackend:
        if self._backend is None:
            factory = backends.get(self.config.backend.name)  # an unknown name fails before any loading
            loaded = self.loaded
            with self._lock:
                if self._backend is None:
                    self._backend = factory.from_config(self.config, loaded=loaded)
        return self._backend

    @property
    def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            self._prompts = PromptBuilder(
                self.backend.tokenizer, self.config.prompt, max_context=self.backend.info.max_context
            )
        return self._prompts

    @property
    def retriever(self) -> Retriever | None:
        """Store + key builder, or None when ``store.kind`` is ``none``."""
        if self._retriever is None and self.config.store.kind != "none":
            loaded = self.loaded
            with self._lock:
                if self._retriever is None:
                    from elm_memory.retrieval.retriever import Retriever

                    self._retriever = Retriever.from_config(self.config, loaded)
        return self._retriever

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:
            from elm_memory.verifiers.base import build_verifier

            self._verifier = build_verifier(self.config, self.backend)
        return self._verifier

    @property
    def learner(self) -> MemoryLearner:
        if self._learner is not None:
            return self._learner
        with self._learner_lock:
            if self._learner is None:
                from pathlib import Path

                from elm_memory.jobs import build_learner, default_queue_path

                lc = self.config.learner
                if lc.mode == "background" and self.config.training.engine == "trl":
                    raise ConfigError(
                        "training.engine=trl wraps the shared model while training; use learner.mode=sync"
                    )
                if lc.mode != "off" and self.retriever is None:
                    raise ConfigError("learning needs a memory store (store.kind is 'none'); set learner.mode=off")
                queue = (
                    Path(lc.queue_path).expanduser() if lc.queue_path else default_queue_path(self.config.store.path)
                )
                self._learner = build_learner(
                    lc.mode,
                    self.learn_from_job,
                    queue,
                    scope=self.loaded.info.fingerprint,
                    max_attempts=lc.max_attempts,
                    poll_interval=lc.poll_interval,
                    batch_size=lc.batch_size,
                    learn_many_fn=self.learn_from_jobs,
                    config=self.config,
                    worker_factory=ELM,  # what a ray learner's actors build (jobs never imports the facade)
                )
        return self._learner

    @property
    def graph(self) -> Any:
        """The compiled ELM graph bound to this instance's services (usable as a subgraph)."""
        if self._graph is None:
            from elm_memory.graph import build_elm_graph

            self._graph = build_elm_graph(self.services, config=self.config)
        return self._graph

    def services(self) -> ELMServices:
        """The live parts the graph's nodes use (see ``ELMServices``), built on first call."""
        if self._services is None:
            from elm_memory.graph import ELMServices

            streams = None
            if self.config.stream.mode != "per_question":
                from elm_memory.graph.stream import stream_memories

                streams = stream_memories(self.config, self.loaded, self.backend)
            services = ELMServices(
                config=self.config,
                backend=self.backend,
                prompts=self.prompts,
                retriever=self.retriever,
                verifier=self.verifier,
                learner=self.learner,
                streams=streams,
            )
            with self._lock:
                if self._services is None:
                    self._services = services
                return self._services
        return self._services

    # -- API -------------------------------------------------------------------------
    def answer(
        self, question: Any, *, namespace: str | None = None, learn: bool = True, context: Any = None
    ) -> AnswerResult:
        """Answer one question through the ELM graph; then submit it for learning (unless ``learn=False``).

        ``context``: the run's JSON settings (``ELMRunContext`` or a dict, e.g. ``{"user_id": "ada"}``
        to fill ``namespace_template``); an explicit ``namespace`` wins over it.
        """
        question = validate_question(question)  # before any model loading: bad input fails fast
        run: dict[str, Any] = {"question": question, "learn": learn}
        if namespace is not None:
            run["namespace"] = validate_namespace(namespace)
        elif not self.config.namespace_template:
            validate_namespace(self.config.namespace)  # the graph would use it: refuse it before model work
        out = self.graph.invoke(run, context=context)
        return AnswerResult(
            question=question,
            answer=out.get("answer"),
            response=out.get("response", ""),
            route=out.get("route", "zero_shot"),
            memory_id=out.get("memory_id"),
            similarity=out.get("similarity"),
            candidates=[dict(c) for c in out.get("candidates") or []],
            timings=dict(out.get("timings") or {}),
            warnings=list(out.get("warnings") or []),
            learn_job=out.get("learn_job"),
            namespace=out.get("namespace"),
            gate=out.get("gate"),
            verifier_sample_answers=out.get("verifier_sample_answers"),
            presampled_answers=out.get("presampled_answers"),
            stream_update=out.get("stream_update"),
            stream_turn=out.get("stream_turn"),
        )

    def learn(
        self,
        question: Any,
        *,
        namespace: str | None = None,
        progress: bool | None = None,
        store: bool = True,
        memory_id: str | None = None,
        config: ELMConfig | None = None,
    ) -> LatentMemory:
        """Learn a memory from ``question`` (GRPO on a soft prompt, majority-vote rewards) and store it.

        Nothing is stored unless training completes: an interrupt or a NaN leaves the pool as it was. Each
        call learns a new memory, also for a question learned before; :meth:`answer`'s learner learns a
        question once per namespace, and says when it reused the memory it has (``learn_job["reused"]``).
        """
        from elm_memory.training.learn import learn_memory

        question = validate_question(question)
        # before any model work: the store would refuse it only after training
        namespace = validate_namespace((config or self.config).namespace if namespace is None else namespace)
        memory = learn_memory(
            question,
            config=config or self.config,
            loaded=self.loaded,
            backend=self.backend,
            prompts=self.prompts,
            namespace=namespace,
            progress=progress,
            memory_id=memory_id,
        )
        if store and self.retriever is not None:
            self.retriever.index_memory(memory)
        return memory

    def learn_many(
        self,
        questions: Sequence[Any],
        *,
        namespace: str | Sequence[str] | None = None,
        progress: bool | None = None,
        store: bool = True,
        memory_ids: Sequence[str | None] | None = None,
        config: ELMConfig | None = None,
        batch_size: int | None = None,
        on_step: StepCallback | None = None,
    ) -> list[LatentMemory]:
        """Learn one memory per question, ``batch_size`` at a time (None: all together) trained in
        one batch (each memory equals the one :meth:`learn` makes alone), and store each batch's
        memories once it completes. ``namespace``: one for all, or one per question. ``on_step(done,
        steps)`` is called after each training step of each batch (for progress displays)."""
        from elm_memory.training.learn import learn_memories

        cfg = config or self.config
        questions = [validate_question(q) for q in questions]
        if namespace is None or isinstance(namespace, str):
            namespaces = [namespace] * len(questions)
        else:
            namespaces = list(namespace)
        # before any model work: the store would refuse them only after training
        namespaces = [validate_namespace(cfg.namespace if ns is None else ns) for ns in namespaces]
        ids = list(memory_ids) if memory_ids is not None else [None] * len(questions)
        if len(namespaces) != len(questions) or len(ids) != len(questions):
            raise ConfigError("learn_many needs one namespace and one memory id per question")
        size = batch_size or max(1, len(questions))
        memories: list[LatentMemory] = []
        for start in range(0, len(questions), size):
            part = slice(start, start + size)
            batch = learn_memories(
                questions[part],
                config=cfg,
                loaded=self.loaded,
                backend=self.backend,
                prompts=self.prompts,
                namespace=namespaces[part],
                progress=progress,
                memory_ids=ids[part],
                on_step=on_step,
            )
            if store and self.retriever is not None:
                for memory in batch:
                    self.retriever.index_memory(memory)
            memories.extend(batch)
        return memories

    def _job_config(self, job: Any) -> ELMConfig:
        if not job.config_overrides:
            return self.config
        return ELMConfig.from_dict(deep_merge(self.config.model_dump(mode="json"), job.config_overrides))

    def learn_from_jobs(self, jobs: list[Any]) -> list[str | Exception]:
        """The learner's batch: jobs with the same config overrides train together. A group that
        fails gives its exception to each of its jobs; the learner then reruns those alone."""
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(json.dumps(job.config_overrides, sort_keys=True), []).append(i)
        results: list[str | Exception] = [RuntimeError("not run")] * len(jobs)
        for idx in groups.values():
            group = [jobs[i] for i in idx]
            try:
                memories = self.learn_many(
                    [j.question for j in group],
                    namespace=[j.namespace for j in group],
                    memory_ids=[j.job_id for j in group],
                    config=self._job_config(group[0]),
                    progress=False,
                )
            except Exception as exc:
                for i in idx:
                    results[i] = exc
            else:
                for i, memory in zip(idx, memories, strict=True):
                    results[i] = memory.id
        return results

    def learn_from_job(self, job: Any) -> str:
        """The learner's job: the memory id is the job id, so a re-run overwrites, never duplicates."""
        config = self._job_config(job)
        memory = self.learn(job.question, namespace=job.namespace, memory_id=job.job_id, config=config, progress=False)
        return memory.id
