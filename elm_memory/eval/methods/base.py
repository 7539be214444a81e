"""What an evaluation method is: answer a question, then (online) update its own pool.

All methods of one run share one :class:`EvalRuntime`: one loaded model, one backend,
one prompt builder and one verifier, so comparing methods never loads a model twice.
Ground truth never reaches a method; the runner scores the answers afterwards.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.errors import ConfigError, RegistryError
from elm_memory.eval.records import run_dir


@dataclass
class MethodOutput:
    """One method's answer to one question (what the runner records)."""

    answer: str | None
    response: str
    # "zero_shot" | "agree" | "answered" | "verifier" | "vote" | "context" (a retrieved text example/strategy was used)
    route: str
    memory_id: str | None = None
    similarity: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)  # kind, answer, score
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EvalMethod(Protocol):
    """``answer`` sees only the question; ``learn`` then updates the method's pool (no-op for
    memoryless methods). ``pool_stats`` returns (entries, bytes on disk).

    Optional hooks the runner looks for: ``answer_batch`` (memoryless methods, batched across the
    stream), ``answer_and_learn`` with ``overlap`` (both side by side), ``record_ground_truth`` (after
    scoring), ``resume(records)`` (once, on a resumed run, with the method's own earlier records) and
    ``abandon()`` (instead of ``close`` when the run is interrupted: stop without finishing queued work)."""

    name: str

    def answer(self, question: str, index: int) -> MethodOutput: ...

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None: ...

    def pool_stats(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


class EvalRuntime:
    """Shared parts of one evaluation run: one loaded model and one backend (behind a greedy
    cache, see ``elm_memory.eval.cache``), reached through a zero-shot ELM facade (no store,
    no learner). Methods with pools keep them under ``out_dir``. Built lazily: a resumed run
    with nothing left to do never loads the model."""

    def __init__(
        self, config: ELMConfig, out_dir: str | Path, *, loaded: Any = None, backend: Any = None, paired: bool = True
    ):
        """``loaded``/``backend``: reuse a model already in memory (tests, notebooks); it is not closed here.
        ``paired``: ELM methods also record what the paired baselines need (:mod:`elm_memory.eval.paired`):
        one more greedy decode per question with a memory, k samples on a question where ELM drew none."""
        self.config = config
        self.paired = paired
        self.out_dir = run_dir(out_dir)
        self._base: ELM | None = None
        self._cache: Any = None  # the GreedyCache in front of the backend, once built
        self._raw_backend: Any = None
        self._given = (loaded, backend)

    @property
    def base(self) -> ELM:
        if self._base is None:
            from elm_memory.backends.registry import backends
            from elm_memory.eval.cache import GreedyCache
            from elm_memory.models.loading import load_model

            cfg = self.config
            loaded, backend = self._given
            if backend is None:
                factory = backends.get(cfg.backend.name)
                loaded = loaded or load_model(cfg.model)
                backend = self._raw_backend = factory.from_config(cfg, loaded=loaded)
            loaded = loaded or backend.loaded
            zero_shot_cfg = cfg.model_copy(
                update={
                    "store": cfg.store.model_copy(update={"kind": "none"}),
                    "learner": cfg.learner.model_copy(update={"mode": "off"}),
                }
            )
            self._cache = GreedyCache(backend)
            self._base = ELM(zero_shot_cfg, loaded=loaded, backend=self._cache)
        return self._base

    @property
    def greedy_cache(self) -> Any:
        """The :class:`~elm_memory.eval.cache.GreedyCache` every method's greedy calls go through
        (loads the model on first use)."""
        self.base  # noqa: B018 - builds the cache with the backend
        return self._cache

    @property
    def shared_generations(self) -> int:
        """Greedy generations served from the cache so far (another method had made them); 0 before
        the model is loaded."""
        return self._cache.hits if self._cache is not None else 0

    @property
    def backend(self) -> Any:
        return self.base.backend

    @property
    def prompts(self) -> Any:
        return self.base.prompts

    @property
    def loaded(self) -> Any:
        return self.base.loaded

    def seed_for(self, index: int) -> int:
        """A per-question seed: sampled methods give the same samples when a run is resumed."""
        return random.Random(f"{self.config.training.seed}:{index}").randrange(2**31)

    def close(self) -> None:
        if self._base is not None:
            self._base.close()
        if self._raw_backend is not None and hasattr(self._raw_backend, "close"):
            self._raw_backend.close()  # e.g. a vLLM engine


def open_runtime(
    config: ELMConfig, out: Path, runtime: EvalRuntime | None, *, paired: bool = True
) -> tuple[EvalRuntime, bool]:
    """The run's runtime and whether the runner owns it (then it closes it): the caller's, which must
    keep its pools in the same run directory, or a new one (cheap: nothing loads before it is used)."""
    if runtime is None:
        return EvalRuntime(config, out, paired=paired), True
    if runtime.out_dir != out:
        raise ConfigError(f"the runtime keeps its pools in {runtime.out_dir}, not in the run directory {out}")
    return runtime, False


def memory_store_config(config: ELMConfig, run_directory: Path, method: str) -> ELMConfig:
    """``config`` with its store in ``<run_directory>/store``: an evaluation keeps its pools in the run
    directory, in a store of the configured kind (``store.kind``). A method that learns memories needs
    one, so ``none`` is refused by name before any work."""
    if config.store.kind == "none":
        raise ConfigError(f"{method} learns memories into a store, but store.kind is 'none'; set store.kind (chroma)")
    return config.model_copy(update={"store": config.store.model_copy(update={"path": str(run_directory / "store")})})


def build_method(name: str, runtime: EvalRuntime) -> EvalMethod:
    from elm_memory.eval.methods.registry import eval_methods

    method = eval_methods.get(name)(runtime)
    if not isinstance(method, EvalMethod):
        raise RegistryError(f"evaluation method {name!r} built a {type(method).__name__} without answer/learn")
    return method


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
