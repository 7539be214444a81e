"""Configuration: one pydantic model per concern, assembled into :class:`ELMConfig`.

Every hyperparameter of the method is a documented field whose default is the value published
in the ELM paper (Qwen2.5-Math-7B setting). Machine-sized variations are *presets* (YAML files
in ``elm_memory/presets``) layered on top:

>>> cfg = ELMConfig.load(preset="cpu-tiny", overrides={"training": {"steps": 2}})

Unknown keys are errors (``extra="forbid"``), so a typo never silently falls back to a default.

* :mod:`~elm_memory.config.method`: the method's sections (prompt, generation, memory, training,
  retrieval, verifier), defaults from the paper;
* :mod:`~elm_memory.config.deployment`: where it runs (model loading, store, backend, learner);
* :mod:`~elm_memory.config.loading`: presets, YAML files and ``section.key=value`` overrides;
* :mod:`~elm_memory.config.elm_config`: :class:`ELMConfig`, the sections together.
"""

from elm_memory.config.deployment import BackendConfig, LearnerConfig, ModelConfig, StoreConfig
from elm_memory.config.elm_config import ELMConfig
from elm_memory.config.env_settings import config_from_env
from elm_memory.config.loading import (
    available_presets,
    deep_merge,
    load_preset_dict,
    parse_override,
    parse_overrides,
)
from elm_memory.config.method import (
    PAPER_PROMPT,
    GenerationConfig,
    MemoryConfig,
    PromptConfig,
    RetrievalConfig,
    TrainingConfig,
    VerifierConfig,
)
from elm_memory.config.section import ConfigSection
from elm_memory.config.stream import FORMAT_INSTRUCTION, StreamConfig, StreamTuning

__all__ = [
    "FORMAT_INSTRUCTION",
    "PAPER_PROMPT",
    "BackendConfig",
    "ConfigSection",
    "ELMConfig",
    "GenerationConfig",
    "LearnerConfig",
    "MemoryConfig",
    "ModelConfig",
    "PromptConfig",
    "RetrievalConfig",
    "StoreConfig",
    "StreamConfig",
    "StreamTuning",
    "TrainingConfig",
    "VerifierConfig",
    "available_presets",
    "config_from_env",
    "deep_merge",
    "load_preset_dict",
    "parse_override",
    "parse_overrides",
]
