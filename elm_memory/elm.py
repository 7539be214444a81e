"""The ELM facade: wires config -> model, backend, prompt builder (and, as they land, the
store, verifier, trainer and graph). It holds no method logic of its own."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elm_memory.answers import extract_answer
from elm_memory.backends.base import GenerationBackend, PromptInput, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.memory import LatentMemory
from elm_memory.models.loading import LoadedModel, load_model
from elm_memory.models.prompting import BuiltPrompt, PromptBuilder, validate_question
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ELM:
    """Entry point for library users::

    elm = ELM.from_config(ELMConfig.load(preset="cpu-demo"))
    result = elm.answer("What is 17 + 25?")
    """

    def __init__(
        self,
        config: ELMConfig,
        *,
        loaded: LoadedModel | None = None,
        backend: GenerationBackend | None = None,
    ):
        self.config = config
        self._loaded = loaded
        self._backend = backend
        self._prompts: PromptBuilder | None = None

    @classmethod
    def from_config(cls, config: ELMConfig | None = None, **load_kwargs: Any) -> ELM:
        return cls(config or ELMConfig.load(**load_kwargs))

    # -- lazily built parts ----------------------------------------------------------
    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            self._loaded = load_model(self.config.model)
        return self._loaded

    @property
    def backend(self) -> GenerationBackend:
        if self._backend is None:
            factory = backends.get(self.config.backend.name)
            self._backend = factory.from_config(self.config, loaded=self.loaded)
        return self._backend

    @property
    def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            self._prompts = PromptBuilder(
                self.backend.tokenizer, self.config.prompt, max_context=self.backend.info.max_context
            )
        return self._prompts

    # -- building blocks -------------------------------------------------------------
    def build_prompt(self, question: Any) -> BuiltPrompt:
        reserve = self.config.memory.num_tokens + 1  # a memory and at least one answer token must fit
        return self.prompts.build(question, reserve=reserve)

    def answer_params(self, prompt_len: int) -> SamplingParams:
        g = self.config.generation
        room = self.backend.info.max_context - prompt_len
        return SamplingParams(
            max_new_tokens=max(1, min(g.max_new_tokens, room)),
            temperature=g.temperature,
            top_p=g.top_p,
            stop_at_answer=g.stop_at_answer,
            seed=self.config.training.seed,
        )

    # -- API -------------------------------------------------------------------------
    def learn(self, question: Any, *, namespace: str | None = None, progress: bool | None = None) -> LatentMemory:
        """Learn a memory from ``question`` (GRPO on a soft prompt with majority-vote rewards)."""
        from elm_memory.training.learn import learn_memory

        question = validate_question(question)
        return learn_memory(
            question,
            config=self.config,
            loaded=self.loaded,
            backend=self.backend,
            prompts=self.prompts,
            namespace=namespace,
            progress=progress,
        )

    def answer(self, question: Any, *, namespace: str | None = None) -> AnswerResult:
        """Answer one question. Zero-shot for now; retrieval and routing arrive with the graph."""
        t0 = time.perf_counter()
        question = validate_question(question)  # before any model loading: bad input fails fast
        prompt = self.build_prompt(question)
        params = self.answer_params(len(prompt.token_ids) + self.config.memory.num_tokens)
        t1 = time.perf_counter()
        [[gen]] = self.backend.generate([PromptInput(prompt.token_ids)], params)
        t2 = time.perf_counter()
        return AnswerResult(
            question=question,
            answer=extract_answer(gen.text),
            response=gen.text,
            route="zero_shot",
            candidates=[{"kind": "zero_shot", "answer": extract_answer(gen.text), "tokens": len(gen.token_ids)}],
            timings={"prompt": t1 - t0, "generate": t2 - t1, "total": t2 - t0},
        )
