from __future__ import annotations

import pytest

from elm_memory.config import PAPER_PROMPT, ELMConfig, available_presets, parse_override
from elm_memory.errors import ConfigError


def test_defaults_are_the_papers_values():
    cfg = ELMConfig()
    t = cfg.training
    assert (cfg.memory.num_tokens, cfg.memory.init) == (20, "question")
    assert (t.steps, t.num_generations, t.learning_rate, t.beta, t.loss_type) == (10, 8, 1e-4, 0.01, "dr_grpo")
    assert t.max_completion_length == 2048 and cfg.generation.max_new_tokens == 2048
    assert cfg.generation.temperature == 0.0  # greedy pass@1
    assert (cfg.retrieval.key, cfg.retrieval.top_k) == ("input", 1)
    assert cfg.verifier.name == "prm" and cfg.verifier.model == "Qwen/Qwen2.5-Math-PRM-7B"
    assert cfg.prompt.template == PAPER_PROMPT
    assert (
        PAPER_PROMPT.replace("{question}", "Q")
        == "Please reason step by step, and put your final answer within \\boxed{}.\nQ"
    )


@pytest.mark.parametrize(
    "model_type, expected", [("qwen2", 0.8), ("llama", 0.7), ("LlamaForCausalLM", 0.7), (None, 0.8)]
)
def test_rollout_temperature_follows_the_paper_per_family(model_type, expected):
    assert ELMConfig().training.effective_temperature(model_type) == expected
    assert ELMConfig.load(overrides={"training": {"temperature": 0.5}}).training.effective_temperature("llama") == 0.5


def test_presets_exist_and_shrink_the_run():
    assert {"cpu-demo", "cpu-tiny", "paper"} <= set(available_presets())
    demo = ELMConfig.load(preset="cpu-demo")
    tiny = ELMConfig.load(preset="cpu-tiny")
    assert demo.model.name_or_path == "packaged:qwen2.5-coder-0.5b"
    assert tiny.model.name_or_path == "packaged:smollm2-135m"
    for cfg in (demo, tiny):
        assert cfg.training.steps < 10 and cfg.training.num_generations < 8
        assert cfg.training.max_completion_length < 2048
        assert cfg.memory.num_tokens == 20 and cfg.training.learning_rate == 1e-4  # method values kept
    # the demo votes with the memory beside self-consistency's samples; the method's default is the paper's route
    assert (demo.verifier.name, demo.verifier.route) == ("consistency", "vote")
    assert ELMConfig.load().verifier.route == "verify"


def test_yaml_round_trip(tmp_path):
    cfg = ELMConfig.load(preset="cpu-demo", overrides={"retrieval": {"key": "kv", "min_similarity": 0.3}})
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    again = ELMConfig.from_yaml(path)
    assert again == cfg
    assert again.retrieval.key == "kv" and again.retrieval.min_similarity == 0.3


def test_layering_preset_then_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  steps: 3\n  num_generations: 5\n")
    cfg = ELMConfig.load(path, preset="cpu-tiny", overrides={"training": {"steps": 7}})
    assert cfg.training.steps == 7  # override beats file
    assert cfg.training.num_generations == 5  # file beats preset
    assert cfg.model.name_or_path == "packaged:smollm2-135m"  # preset beats default


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preset": "nope"}, "unknown preset 'nope'"),
        ({"overrides": {"training": {"stepz": 1}}}, "unknown config key 'training.stepz'"),
        ({"overrides": {"training": {"steps": -1}}}, "training.steps"),
        ({"overrides": {"prompt": {"template": "no placeholder"}}}, "{question}"),
        (
            {"preset": "cpu-demo", "overrides": {"backend": {"decode_loop": "generate"}}},
            "backend.lookup_draft_tokens=3 needs backend.decode_loop=elm",
        ),
    ],
)
def test_bad_config_is_a_typed_one_line_error(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ELMConfig.load(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_assignment_is_checked_as_loading_is_and_a_refused_one_changes_nothing():
    cfg = ELMConfig(verifier={"name": "consistency"}, stream={"mode": "stream"})
    cfg.stream.serving = "amortized"  # learn_from left unset follows serving, as when loaded
    assert (cfg.stream.tuning.learn_from, cfg.stream.tuning.objective) == ("zero_shot", "sft")
    own = ELMConfig(verifier={"name": "consistency"}, stream={"mode": "stream", "tuning": {"learn_from": "own"}})
    with pytest.raises(ConfigError, match=r"StreamConfig\.serving = 'amortized' is refused: .*learn_from=zero_shot"):
        own.stream.serving = "amortized"
    assert (own.stream.serving, own.stream.tuning.learn_from) == ("vote", "own")
    with pytest.raises(ConfigError, match=r"max_new_tokens = 'many' is refused: .*integer"):
        own.generation.max_new_tokens = "many"
    assert own.generation.max_new_tokens == ELMConfig().generation.max_new_tokens
    assert "max_new_tokens" not in own.generation.model_fields_set


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ELMConfig.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ELMConfig.load(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        ELMConfig.load(listy)


def test_parse_override():
    assert parse_override("training.steps=2") == {"training": {"steps": 2}}
    assert parse_override("retrieval.min_similarity=null") == {"retrieval": {"min_similarity": None}}
    with pytest.raises(ConfigError):
        parse_override("training.steps")


def test_stream_settings_a_user_sets_are_few_and_the_tuned_ones_sit_in_stream_tuning():
    from elm_memory.config import StreamConfig

    assert set(StreamConfig.model_fields) == {
        "mode", "kind", "serving", "learning_rate", "probe_share", "keep_versions", "tuning"
    }  # fmt: skip
    cfg = ELMConfig.load(overrides=parse_override("stream.tuning.guard_window=4"))
    assert cfg.stream.tuning.guard_window == 4


def test_a_stream_setting_that_moved_into_tuning_still_loads_with_a_warning_naming_its_new_place():
    with pytest.warns(DeprecationWarning, match=r"stream\.tuning\.guard_window, stream\.tuning\.learn_from"):
        cfg = ELMConfig.load(overrides={"stream": {"guard_window": 4, "learn_from": "zero_shot"}})
    assert cfg.stream.tuning.guard_window == 4
    assert (cfg.stream.tuning.learn_from, cfg.stream.tuning.objective) == ("zero_shot", "sft")  # follows, as before
    with pytest.warns(DeprecationWarning):  # the new spelling wins where both are given
        both = ELMConfig.load(overrides={"stream": {"guard_window": 4, "tuning": {"guard_window": 6}}})
    assert both.stream.tuning.guard_window == 6
    with pytest.raises(ConfigError, match="did you mean 'guard_window'"):
        ELMConfig.load(overrides={"stream": {"tuning": {"guard_windw": 4}}})
