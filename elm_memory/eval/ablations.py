"""The paper's ablation table as one run (``elm offline --ablations``).

Each variant is the offline protocol (:mod:`elm_memory.eval.offline`: one memory per question, each
evaluated on the whole set) with a few config overrides, run on the same questions into its own
subdirectory of the run directory (each resumable on its own). ``ablations.md`` then puts the
variants side by side with the offline metrics, one row each, like the paper's Table
"The effect of objective and only 2 training steps" (appendix, ``tab:ablations``).

:data:`ABLATIONS` is the list: a name (its subdirectory), the paper's row it reproduces, and the
overrides (dotted config keys, as ``--set`` takes them) applied on top of the run's config. Add a
row by adding a :class:`Variant`. A variant may change any setting but the model and the backend:
all variants share one loaded model and one greedy cache, so zero-shot is answered once.

Rows of the paper's ablation and memory-design tables that no config setting expresses are in
:data:`NOT_EXPRESSIBLE`, with the reason, and are listed under the table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elm_memory.config import ELMConfig, deep_merge
from elm_memory.data.datasets import Problem
from elm_memory.errors import ConfigError
from elm_memory.eval.records import RecordLog, run_dir, write_json_atomic


@dataclass(frozen=True)
class Variant:
    """One row of the ablation table: ``overrides`` (``{"training.steps": 2}``) on the run's config."""

    name: str
    paper_row: str
    overrides: Mapping[str, Any] = field(default_factory=dict)


#: The paper's ablation rows the library expresses (appendix table ``tab:ablations``; Qwen2.5-Math-7B:
#: zero-shot 50 / 10, ELM 65 / 20, ELM-2 S 62.5 / 16.7, ELM-SFT 62.5 / 13.3 on AMC23 / AIME24).
ABLATIONS: tuple[Variant, ...] = (
    Variant("elm", "ELM (GRPO, majority reward, the config's S: paper 10)"),
    Variant("elm-2-steps", "ELM-2 S (S=2 GRPO steps)", {"training.steps": 2}),
    Variant("elm-sft", "ELM-SFT (SFT on the greedy answer)", {"training.objective": "sft"}),
    # The memory-design rows (Table 1): the same GRPO loop, another parameterisation (memory.kind picks
    # the paper's learning rate for each: 1e-4 LoRA rank 16, 1e-3 prefix).
    Variant("elm-lora", "ELM-LoRA (rank 16 on attention and MLP projections)", {"memory.kind": "lora"}),
    Variant("elm-prefix", "ELM-PrefixTuning (per-layer K/V prefix from the question)", {"memory.kind": "prefix"}),
)

#: Rows of the paper's ablation and memory-design tables this table cannot hold, and why.
NOT_EXPRESSIBLE: tuple[tuple[str, str], ...] = (
    (
        "ELM-Full Model (Table 1, per-question full-model training)",
        "no engine trains the model's own weights per memory (the model is frozen); the full-dataset "
        "full-model rows (GRPO, TTRL) are `elm offline --full-model`",
    ),
    (
        "retrieval key and verifier choices",
        "the offline protocol has no retrieval or routing: every memory answers every question",
    ),
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: Sections every variant must share: one model and one backend serve them all.
_SHARED_SECTIONS = ("model", "backend")


@dataclass
class AblationResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    table: str
    summary: dict[str, Any] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)  # none: each variant's folder has its own


def variant_config(config: ELMConfig, variant: Variant) -> ELMConfig:
    """``config`` with the variant's overrides; refused when they touch the shared model or backend."""
    nested: dict[str, Any] = {}
    for dotted, value in variant.overrides.items():
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        cfg = ELMConfig.from_dict(deep_merge(config.model_dump(mode="json"), nested))
    except ConfigError as exc:
        raise ConfigError(f"ablation variant {variant.name!r}: {exc}") from None
    for section in _SHARED_SECTIONS:
        if getattr(cfg, section) != getattr(config, section):
            raise ConfigError(
                f"ablation variant {variant.name!r} changes the {section} section, which all variants share; "
                "run it as its own `elm offline`"
            )
    return cfg


def run_ablations(
    problems: Sequence[Problem],
    config: ELMConfig,
    out_dir: str | Path,
    *,
    variants: Sequence[Variant] = ABLATIONS,
    dataset: str = "custom",
    seed: int | None = None,
    train: int | None = None,
    batch_size: int = 8,
    loaded: Any = None,
    backend: Any = None,
    progress: bool | None = None,
    plots: bool = True,
) -> AblationResult:
    """Every variant's offline run into ``out_dir/<name>``, then ``ablations.md`` and ``ablations.json``.
    ``loaded``/``backend``: a model already in memory (tests, notebooks)."""
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.offline import run_offline
    from elm_memory.eval.report import markdown_ablations

    out = run_dir(out_dir)
    if not variants:
        raise ConfigError("no ablation variants to run")
    names = [v.name for v in variants]
    for name in names:
        if not _NAME.fullmatch(name):
            raise ConfigError(f"ablation variant name {name!r} is not a folder name (letters, digits, _ . -)")
    if len(set(names)) != len(names):
        raise ConfigError(f"ablation variant names repeat: {', '.join(names)}")
    configs = [variant_config(config, v) for v in variants]  # every variant checked before any work
    shared = SharedBackend(config, loaded, backend)
    rows = []
    try:
        for variant, cfg in zip(variants, configs, strict=True):
            sub = out / variant.name
            result = run_offline(
                problems,
                cfg,
                sub,
                dataset=dataset,
                seed=seed,
                train=train,
                batch_size=batch_size,
                runtime=EvalRuntime(cfg, sub, backend=shared),
                progress=progress,
                plots=plots,
            )
            rows.append(_row(variant, cfg, result.summary, sub))
    finally:
        shared.close()
    summary = {
        "dataset": dataset,
        "seed": seed,
        "question_ids": [p.id for p in problems],
        "variants": rows,
        "not_expressible": [{"row": row, "why": why} for row, why in NOT_EXPRESSIBLE],
    }
    table = markdown_ablations(rows, NOT_EXPRESSIBLE)
    write_json_atomic(out / "ablations.json", summary)
    (out / "ablations.md").write_text(table, encoding="utf-8")
    return AblationResult(out_dir=out, rows=rows, table=table, summary=summary)


def _row(variant: Variant, cfg: ELMConfig, summary: dict[str, Any], sub: Path) -> dict[str, Any]:
    """One table row: what the variant is, and its offline metrics."""
    seconds = [float(r["seconds"]) for r in RecordLog(sub / "memories.jsonl").read() if r.get("seconds") is not None]
    best = summary.get("best_memory")
    return {
        "variant": variant.name,
        "paper_row": variant.paper_row,
        "overrides": dict(variant.overrides),
        "objective": cfg.training.objective,
        "steps": cfg.training.steps,
        "n_questions": summary["n_questions"],
        "n_memories": summary["n_memories"],
        "zero_shot_accuracy": summary["zero_shot_accuracy"],
        "best_memory_accuracy": None if best is None else best["accuracy"],
        "mean_memory_accuracy": summary["mean_memory_accuracy"],
        "oracle_accuracy": summary["oracle_accuracy"],
        "fraction_improving": summary["fraction_improving"],
        "mean_negative_flip_rate": summary["mean_negative_flip_rate"],
        "top_flip": summary["top_flip"],
        "iou_top2": summary["iou_top2"],
        "learn_seconds_mean": sum(seconds) / len(seconds) if seconds else None,
        "run_dir": variant.name,
    }


class SharedBackend:
    """The backend every variant answers and learns with: built on first use (a finished run loads
    nothing), behind one greedy cache, so the variants' identical zero-shot answers are generated once."""

    def __init__(self, config: ELMConfig, loaded: Any = None, backend: Any = None):
        self._config, self._loaded, self._given = config, loaded, backend
        self._cache: Any = None
        self._owned: Any = None  # a backend built here, closed here

    def _backend(self) -> Any:
        if self._cache is None:
            from elm_memory.backends.registry import backends
            from elm_memory.eval.cache import GreedyCache
            from elm_memory.models.loading import load_model

            backend = self._given
            if backend is None:
                loaded = self._loaded or load_model(self._config.model)
                backend = self._owned = backends.get(self._config.backend.name).from_config(self._config, loaded=loaded)
            self._cache = GreedyCache(backend)
        return self._cache

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle probes must not load a model
            raise AttributeError(name)
        return getattr(self._backend(), name)

    def close(self) -> None:
        if self._owned is not None and hasattr(self._owned, "close"):
            self._owned.close()
