"""A config from the environment (``elm_memory.config.env_settings``, pydantic-settings): the served
graphs' settings, nested fields as ``ELM_<SECTION>__<KEY>``, ``ELM_SET`` kept for one release."""

from __future__ import annotations

import os

import pytest

from elm_memory.config import ELMConfig
from elm_memory.config.env_settings import config_from_env
from elm_memory.errors import ConfigError


@pytest.fixture(autouse=True)
def no_elm_settings(monkeypatch):
    """Only what a test sets: ELM_ variables of the surrounding shell would change the results."""
    for name in list(os.environ):
        if name.startswith("ELM_") and name != "ELM_HOME":
            monkeypatch.delenv(name)


def test_nothing_set_is_the_default_preset():
    assert config_from_env(default_preset="cpu-tiny") == ELMConfig.load(preset="cpu-tiny")
    assert config_from_env() == ELMConfig()


def test_nested_variables_set_fields_over_the_preset_and_the_file(monkeypatch, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("training:\n  steps: 5\n  num_generations: 3\nretrieval:\n  min_similarity: 0.5\n")
    monkeypatch.setenv("ELM_CONFIG", str(path))
    monkeypatch.setenv("ELM_PRESET", "cpu-tiny")
    monkeypatch.setenv("ELM_TRAINING__STEPS", "7")  # over the file
    monkeypatch.setenv("ELM_VERIFIER__NAME", "logprob")  # over the preset's self_certainty
    monkeypatch.setenv("ELM_RETRIEVAL__MIN_SIMILARITY", "null")  # read as a --set value: None
    monkeypatch.setenv("ELM_LEARNER__RAY__ADDRESS", "auto")  # a section inside a section
    monkeypatch.setenv("ELM_NAMESPACE_TEMPLATE", "user-{user_id}")  # a top-level field
    cfg = config_from_env(default_preset="cpu-demo")
    assert cfg.model.name_or_path == "packaged:smollm2-135m"  # ELM_PRESET over the default preset
    assert (cfg.training.steps, cfg.training.num_generations) == (7, 3)
    assert cfg.verifier.name == "logprob" and cfg.retrieval.min_similarity is None
    assert cfg.learner.ray.address == "auto" and cfg.namespace_template == "user-{user_id}"
    assert cfg.generation.max_new_tokens == ELMConfig.load(preset="cpu-tiny").generation.max_new_tokens


def test_elm_set_still_works_with_a_warning_naming_the_new_spelling(monkeypatch):
    monkeypatch.setenv("ELM_SET", "verifier.name=logprob; training.steps=3")
    with pytest.warns(DeprecationWarning, match="ELM_VERIFIER__NAME=logprob ELM_TRAINING__STEPS=3"):
        cfg = config_from_env(default_preset="cpu-tiny")
    assert (cfg.verifier.name, cfg.training.steps) == ("logprob", 3)
    monkeypatch.setenv("ELM_TRAINING__STEPS", "4")  # the new spelling wins over the old
    with pytest.warns(DeprecationWarning):
        assert config_from_env(default_preset="cpu-tiny").training.steps == 4


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("ELM_VERIFER__NAME", "logprob", "ELM_VERIFER__NAME: unknown config section 'verifer'; choose one of: "),
        ("ELM_VERIFIER__NAME", "logprobs", "verifier.name: unknown verifier 'logprobs'; choose one of: "),
        ("ELM_TRAINING__STEPZ", "2", "unknown config key 'training.stepz'"),
        ("ELM_VERIFIER", "logprob", "set one key per variable, e.g. ELM_VERIFIER__NAME"),
        ("ELM_TRAINING__STEPS", "[[[", "'ELM_TRAINING__STEPS': the value is not valid YAML"),
    ],
)
def test_a_bad_variable_is_a_one_line_config_error(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        config_from_env(default_preset="cpu-tiny")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_served_graphs_read_the_environment(monkeypatch):
    from elm_memory.graphs import serving

    built = []

    class RecordingELM:
        def __init__(self, cfg):
            built.append(cfg)

    monkeypatch.setattr("elm_memory.elm.ELM", RecordingELM)
    monkeypatch.setattr(serving, "_elm", None)
    monkeypatch.setenv("ELM_PRESET", "cpu-tiny")
    monkeypatch.setenv("ELM_VERIFIER__NAME", "consistency")
    assert isinstance(serving.served_elm(), RecordingELM)
    assert built[0].verifier.name == "consistency" and built[0].model.name_or_path == "packaged:smollm2-135m"
