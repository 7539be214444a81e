"""The ELM facade: wires config -> model, backend, prompt builder, retriever (store + keys),
verifier, learner and the graph. It holds no method logic of its own: answering is the
graph (``elm_memory.graph``), learning is ``elm_memory.training``."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from elm_memory.backends.base import GenerationBackend
from elm_memory.config import ELMConfig, _deep_merge
from elm_memory.errors import ConfigError
from elm_memory.memory import LatentMemory
from elm_memory.models.loading import LoadedModel, load_model
from elm_memory.models.prompting import PromptBuilder, validate_question
from elm_memory.registry import backends


@dataclass
class AnswerResult:
    """What ``ELM.answer`` / ``elm solve --json`` return."""

    question: str
    answer: str | None
    response: str
    route: str  # "zero_shot" | "agree" | "verifier"
    memory_id: str | None = None
    similarity: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    learn_job: dict[str, Any] | None = None

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
        retriever: Any | None = None,
        verifier: Any | None = None,
        learner: Any | None = None,
    ):
        self.config = config
        self._loaded = loaded
        self._backend = backend
        self._retriever = retriever
        self._verifier = verifier
        self._learner = learner
        self._prompts: PromptBuilder | None = None
        self._graph: Any = None
        self._context: Any = None
        self._lock = threading.Lock()  # lazy construction from several request threads
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
    def retriever(self) -> Any | None:
        """Store + key builder, or None when ``store.kind`` is ``none``."""
        if self._retriever is None and self.config.store.kind != "none":
            loaded = self.loaded
            with self._lock:
                if self._retriever is None:
                    from elm_memory.retrieval.retriever import Retriever

                    self._retriever = Retriever.from_config(self.config, loaded)
        return self._retriever

    @property
    def verifier(self) -> Any:
        if self._verifier is None:
            from elm_memory.verifiers.base import build_verifier

            self._verifier = build_verifier(self.config, self.backend)
        return self._verifier

    @property
    def learner(self) -> Any:
        if self._learner is None:
            from pathlib import Path

            from elm_memory.learner import build_learner, default_queue_path

            lc = self.config.learner
            if lc.mode == "background" and self.config.training.engine == "trl":
                raise ConfigError("training.engine=trl wraps the shared model while training; use learner.mode=sync")
            if lc.mode != "off" and self.retriever is None:
                raise ConfigError("learning needs a memory store (store.kind is 'none'); set learner.mode=off")
            queue = Path(lc.queue_path).expanduser() if lc.queue_path else default_queue_path(self.config.store.path)
            self._learner = build_learner(
                lc.mode,
                self._run_learn_job,
                queue,
                scope=self.loaded.info.fingerprint,
                max_attempts=lc.max_attempts,
                poll_interval=lc.poll_interval,
            )
        return self._learner

    @property
    def graph(self) -> Any:
        if self._graph is None:
            from elm_memory.graph import build_elm_graph

            self._graph = build_elm_graph()
        return self._graph

    def context(self) -> Any:
        """The runtime dependencies the graph's nodes receive (see ``ELMContext``)."""
        if self._context is None:
            from elm_memory.graph import ELMContext

            self._context = ELMContext(
                config=self.config,
                backend=self.backend,
                prompts=self.prompts,
                retriever=self.retriever,
                verifier=self.verifier,
                learner=self.learner,
            )
        return self._context

    # -- API -------------------------------------------------------------------------
    def answer(self, question: Any, *, namespace: str | None = None, learn: bool = True) -> AnswerResult:
        """Answer one question through the ELM graph; then submit it for learning (unless ``learn=False``)."""
        question = validate_question(question)  # before any model loading: bad input fails fast
        out = self.graph.invoke(
            {"question": question, "namespace": namespace or self.config.namespace, "learn": learn},
            context=self.context(),
        )
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

        Nothing is stored unless training completes: an interrupt or a NaN leaves the pool as it was.
        """
        from elm_memory.training.learn import learn_memory

        question = validate_question(question)
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

    def _run_learn_job(self, job: Any) -> str:
        """The learner's job: the memory id is the job id, so a re-run overwrites, never duplicates."""
        config = self.config
        if job.config_overrides:
            config = ELMConfig.from_dict(_deep_merge(self.config.model_dump(mode="json"), job.config_overrides))
        memory = self.learn(job.question, namespace=job.namespace, memory_id=job.job_id, config=config,
                            progress=False)  # fmt: skip
        return memory.id
