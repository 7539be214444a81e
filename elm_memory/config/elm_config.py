"""``ELMConfig``: the sections assembled into one config, and how it is loaded and saved.

>>> cfg = ELMConfig.load(preset="cpu-tiny", overrides={"training": {"steps": 2}})
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from elm_memory.config.deployment import BackendConfig, LearnerConfig, ModelConfig, StoreConfig
from elm_memory.config.loading import Layer, read_yaml, summarise_validation_error
from elm_memory.config.method import (
    GenerationConfig,
    MemoryConfig,
    PromptConfig,
    RetrievalConfig,
    TrainingConfig,
    VerifierConfig,
)
from elm_memory.config.section import ConfigSection, registered_name
from elm_memory.config.sources import config_layers, merge_layers
from elm_memory.config.stream import StreamConfig
from elm_memory.errors import ConfigError


class ELMConfig(ConfigSection):
    """Everything ELM needs, with the paper's values as defaults."""

    namespace: str = Field(default="default", description="Memories are only retrieved within their namespace.")
    namespace_template: str | None = Field(
        default=None,
        description=(
            "Namespace per run from its context/configurable, LangMem-style: e.g. `user-{user_id}` keeps "
            "each user's memories apart in one served graph. A run that names a namespace wins; "
            "None: `namespace`."
        ),
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)

    @model_validator(mode="after")
    def _names_are_registered(self) -> ELMConfig:
        """``verifier.name`` and ``retrieval.key`` name registered parts (built-ins or plugins): a typo fails
        here, before any model loads, with the choices. (The deployment sections and ``training.engine``
        check their own names as fields.)"""
        problems = []
        for field, registry, value in (
            ("verifier.name", "verifiers", self.verifier.name),
            ("retrieval.key", "key_builders", self.retrieval.key),
        ):
            try:
                registered_name(registry, value)
            except ValueError as exc:
                problems.append(f"{field}: {exc}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _vote_has_samples(self) -> ELMConfig:
        """``verifier.route=vote`` counts samples: a built-in verifier that draws none cannot serve it."""
        if self.verifier.route == "vote" and self.verifier.name in ("prm", "self_certainty", "logprob"):
            raise ValueError(
                f"verifier.route=vote votes on the consistency verifier's samples; verifier.name="
                f"{self.verifier.name} draws none: set verifier.route=verify as well to route by its scores "
                "(the cpu-demo preset votes), or keep verifier.name=consistency"
            )
        return self

    @model_validator(mode="after")
    def _stream_has_samples(self) -> ELMConfig:
        """A stream memory learns from samples drawn under it: a built-in verifier that draws none cannot serve."""
        if self.stream.mode != "per_question" and self.verifier.name in ("prm", "self_certainty", "logprob"):
            raise ValueError(
                f"stream.mode={self.stream.mode} votes on, and learns from, the consistency verifier's samples; "
                f"verifier.name={self.verifier.name} draws none: set verifier.name=consistency"
            )
        if self.stream.mode != "per_question" and self.stream.tuning.clusters > 1 and self.store.kind == "none":
            raise ValueError(
                f"stream.tuning.clusters={self.stream.tuning.clusters} groups questions by their retrieval keys; "
                "store.kind=none "
                "builds no retriever: set a store.kind or stream.tuning.clusters=1"
            )
        return self

    @model_validator(mode="after")
    def _memory_kind_fits(self) -> ELMConfig:
        """A lora/prefix ``memory.kind`` with a part that cannot handle it fails here, before any model work
        (the parts refuse it too, for configs built otherwise)."""
        kind = self.memory.kind
        if kind == "soft_prompt":
            return self
        if self.retrieval.key == "soft_prompt_mean":
            raise ValueError(
                f"retrieval.key=soft_prompt_mean pools a soft prompt; memory.kind={kind} needs input or kv"
            )
        if self.training.engine == "trl":
            raise ValueError(f"training.engine=trl trains soft prompts only; memory.kind={kind} needs native")
        if self.backend.name == "vllm-server" or (self.backend.name == "vllm" and kind == "prefix"):
            raise ValueError(f"backend.name={self.backend.name} cannot apply a {kind} memory; use hf")
        return self

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        preset: str | None = None,
        overrides: dict[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ELMConfig:
        """Defaults, then the preset, then the YAML file, then the ``ELM_`` environment variables, then
        ``overrides`` (deep-merged; :mod:`~elm_memory.config.sources`). ``ELM_PRESET``/``ELM_CONFIG`` choose the
        preset/file where none is given. ``environ``: the variables to read (default ``os.environ``; ``{}``
        reads none)."""
        return cls.from_layers(config_layers(cls, path, preset=preset, overrides=overrides, environ=environ))

    @classmethod
    def from_layers(cls, layers: Sequence[Layer]) -> ELMConfig:
        """The config :func:`~elm_memory.config.sources.config_layers` describes."""
        return cls.from_dict(merge_layers(layers))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ELMConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(summarise_validation_error(exc, cls)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ELMConfig:
        return cls.from_dict(read_yaml(Path(path)))

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text
