"""A config from the environment (``elm_memory.config.env_settings``): nested fields as ``ELM_<SECTION>__<KEY>``,
``ELM_CONFIG``, ``ELM_PRESET``, ``ELM_SET`` kept for one release; read the same way by ``ELMConfig.load``, the
``elm`` commands and the served graphs, layered defaults < preset < file < environment < overrides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

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


def test_a_stream_variable_of_the_old_spelling_still_sets_its_tuning_setting_with_a_warning(monkeypatch):
    monkeypatch.setenv("ELM_STREAM__TUNING__GATE_ALPHA", "0.01")
    assert config_from_env(default_preset="cpu-tiny").stream.tuning.gate_alpha == 0.01
    monkeypatch.setenv("ELM_STREAM__GUARD_WINDOW", "5")
    with pytest.warns(DeprecationWarning, match=r"stream\.tuning\.guard_window"):
        cfg = config_from_env(default_preset="cpu-tiny")
    assert (cfg.stream.tuning.guard_window, cfg.stream.tuning.gate_alpha) == (5, 0.01)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("ELM_VERIFER__NAME", "logprob", "ELM_VERIFER__NAME: unknown config section 'verifer'; choose one of: "),
        ("ELM_VERIFIER__NAME", "logprobs", "verifier.name: unknown verifier 'logprobs'; choose one of: "),
        ("ELM_TRAINING__STEPZ", "2", "ELM_TRAINING__STEPZ: unknown config key 'training.stepz'; choose one of: "),
        ("ELM_TRAINING__STEPZ", "2", ", temperature, top_p, weight_decay (did you mean 'steps'?)"),
        ("ELM_VERIFIER__NMAE", "logprob", "; choose one of: aggregate, conditioning, consistency_max_new_tokens, "),
        ("ELM_VERIFIER__NMAE", "logprob", "(did you mean 'name'?)"),
        ("ELM_LEARNER__RAY__ADRESS", "auto", "unknown config key 'learner.ray.adress'; choose one of: address, "),
        ("ELM_VERIFIER", "logprob", "set one key per variable, e.g. ELM_VERIFIER__NAME"),
        ("ELM_LEARNER__RAY", "auto", "set one key per variable, e.g. ELM_LEARNER__RAY__ADDRESS"),
        ("ELM_TRAINING____STEPS", "2", "ELM_TRAINING____STEPS: an empty key"),
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


def test_a_misspelt_key_is_named_the_same_way_wherever_it_is_set(tmp_path):
    """A variable, a file and an override: each lists the section's keys and the closest one."""
    hint = "unknown config key 'verifier.nmae'; choose one of: aggregate, conditioning, "
    path = tmp_path / "my.yaml"
    path.write_text("verifier:\n  nmae: logprob\n")
    for kwargs in (
        {"environ": {"ELM_VERIFIER__NMAE": "logprob"}},
        {"path": path, "environ": {}},
        {"overrides": {"verifier": {"nmae": "logprob"}}, "environ": {}},
    ):
        with pytest.raises(ConfigError) as err:
            ELMConfig.load(**kwargs)
        assert hint in str(err.value) and str(err.value).endswith("(did you mean 'name'?)"), str(err.value)


def test_elmconfig_load_reads_the_environment_between_the_file_and_the_overrides(monkeypatch, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("training:\n  steps: 5\n  num_generations: 3\n")
    monkeypatch.setenv("ELM_TRAINING__STEPS", "7")
    monkeypatch.setenv("ELM_VERIFIER__NAME", "logprob")
    cfg = ELMConfig.load(path, preset="cpu-tiny")
    assert (cfg.training.steps, cfg.training.num_generations, cfg.verifier.name) == (7, 3, "logprob")
    assert ELMConfig.load(path, preset="cpu-tiny", overrides={"training": {"steps": 2}}).training.steps == 2
    assert ELMConfig.load(path, preset="cpu-tiny", environ={}).training.steps == 5  # {} reads no variable
    assert ELMConfig.load(path, environ={"ELM_TRAINING__STEPS": "9"}).training.steps == 9  # a mapping of its own


def test_elm_preset_and_elm_config_apply_where_none_is_given(monkeypatch, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("training:\n  steps: 5\n")
    monkeypatch.setenv("ELM_PRESET", "cpu-tiny")
    monkeypatch.setenv("ELM_CONFIG", str(path))
    cfg = ELMConfig.load()
    assert (cfg.model.name_or_path, cfg.training.steps) == ("packaged:smollm2-135m", 5)
    other = tmp_path / "other.yaml"
    other.write_text("training:\n  steps: 6\n")
    cfg = ELMConfig.load(other, preset="cpu-demo")  # given ones win
    assert (cfg.model.name_or_path, cfg.training.steps) == ("packaged:qwen2.5-coder-0.5b", 6)


def test_changed_values_name_the_layer_that_set_each(monkeypatch, tmp_path):
    from elm_memory.config.sources import changed_values, config_layers

    path = tmp_path / "my.yaml"
    path.write_text("training:\n  steps: 5\n  num_generations: 3\nverifier:\n  route: verify\n")
    monkeypatch.setenv("ELM_PRESET", "cpu-tiny")
    monkeypatch.setenv("ELM_CONFIG", str(path))
    monkeypatch.setenv("ELM_VERIFIER__NAME", "logprob")
    layers = config_layers(ELMConfig, overrides={"training": {"steps": 2}}, overrides_source="--set")
    changes = {c.key: (c.value, c.source) for c in changed_values(ELMConfig.from_layers(layers), layers)}
    assert changes["model.name_or_path"] == ("packaged:smollm2-135m", "preset cpu-tiny (ELM_PRESET)")
    assert changes["training.num_generations"] == (3, f"file {path} (ELM_CONFIG)")
    assert changes["verifier.name"] == ("logprob", "environment ELM_VERIFIER__NAME")
    assert changes["training.steps"] == (2, "--set")
    assert "verifier.route" not in changes  # set, but to the default
    assert changed_values(ELMConfig(), []) == []


def elm(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``elm ARGS`` as a subprocess, with the test's environment plus ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_the_cli_reads_the_environment_under_its_set_options():
    r = elm("config", "show", "--preset", "cpu-tiny", ELM_VERIFIER__NAME="logprob", ELM_TRAINING__STEPS="7")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert (shown["verifier"]["name"], shown["training"]["steps"], shown["training"]["num_generations"]) == (
        "logprob",
        7,
        2,  # cpu-tiny's
    )
    r = elm("config", "show", "--changed", "-p", "cpu-tiny", "--set", "training.steps=2", ELM_VERIFIER__NAME="logprob")
    assert r.returncode == 0, r.stderr
    rows = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert rows["verifier.name"].startswith("verifier.name: logprob ") and rows["verifier.name"].endswith(
        "  # environment ELM_VERIFIER__NAME"
    )
    assert rows["training.steps"].endswith("  # --set") and "training.steps: 2 " in rows["training.steps"]
    assert rows["model.name_or_path"].endswith("  # preset cpu-tiny") and "verifier.route" not in rows
    r = elm("config", "show", ELM_VERIFIER__NMAE="logprob")
    assert r.returncode == 2 and r.stderr.startswith("error: ELM_VERIFIER__NMAE: unknown config key 'verifier.nmae'")
    assert "(did you mean 'name'?)" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
