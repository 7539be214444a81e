"""Full-model offline training (``elm offline --full-model``): the reward functions, the GRPOConfig mapping,
the CPU size guard, the flags, and one real TRL run on SmolLM2-135M (cpu-tiny, 2 questions, G=2, 8 tokens).

SmolLM2 never writes \\boxed{}, so its TTRL rewards are all 0 and would train nothing: the real run uses a
reward with a nonzero advantage ([1, 0] per group), so that the weights must move if training works."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch
from _fakes import one_thread
from typer.testing import CliRunner

from elm_memory.cli import app
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import Problem
from elm_memory.errors import ConfigError, TrainingError
from elm_memory.training import full_model as fm
from elm_memory.training.full_model import FullModelSettings

GOLD = "314159265"  # a gold answer no model output or prompt holds by chance


def tiny_config(**training: Any) -> ELMConfig:
    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "generation": {"max_new_tokens": 8},
            "training": {"num_generations": 2, "max_completion_length": 8, **training},
        },
    )


def problems() -> list[Problem]:
    return [
        Problem(id="q1", question="What is 2 + 2?", answer=GOLD),
        Problem(id="q2", question="What is 3 + 5?", answer="8"),
    ]


def digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- pure parts -------------------------------------------------------------------------------


def test_rewards_majority_votes_per_group_and_gold_compares_with_the_answer():
    majority = fm.majority_reward(group_size=3)
    completions = ["\\boxed{4}", "\\boxed{4}", "\\boxed{5}", "\\boxed{7}", "no answer", "\\boxed{7}"]
    prompts = ["a"] * 3 + ["b"] * 3
    assert majority(completions, prompts) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    with pytest.raises(TrainingError, match="different prompts"):
        majority(completions, ["a", "a", "b", "b", "b", "b"])
    gold = fm.gold_reward()
    assert gold(["\\boxed{4}", "\\boxed{\\frac{8}{2}}", "\\boxed{5}", "4"], answer=["4"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_ttrl_training_rows_hold_no_answers():
    assert fm.training_rows(["p1", "p2"], None) == [{"prompt": "p1"}, {"prompt": "p2"}]
    assert fm.training_rows(["p1"], ["7"]) == [{"prompt": "p1", "answer": "7"}]
    with pytest.raises(ConfigError, match="1 gold answers for 2 prompts"):
        fm.training_rows(["p1", "p2"], ["7"])


def test_questions_per_step_divides_the_set_so_no_question_is_dropped():
    assert [fm.questions_per_step(n, 8) for n in (40, 30, 7, 13, 2, 1)] == [8, 6, 7, 1, 2, 1]


def test_settings_are_checked():
    assert FullModelSettings().method == "TTRL" and FullModelSettings(reward="gold").method == "GRPO"
    for bad, match in (({"epochs": 0}, "epochs"), ({"reward": "gt"}, "unknown reward"), ({"learning_rate": 0}, "rate")):
        with pytest.raises(ConfigError, match=match):
            FullModelSettings(**bad)


class _Info:
    def __init__(self, device: str):
        self.device, self.name = device, "big-model"


class _Loaded:
    """A LoadedModel stand-in whose model reports ``n`` parameters (a meta tensor: no memory)."""

    def __init__(self, n: int, device: str = "cpu"):
        self.model = torch.nn.Module()
        self.model.weight = torch.nn.Parameter(torch.empty(n, device="meta"))
        self.info = _Info(device)


def test_large_models_are_refused_on_a_cpu_unless_forced():
    limit = fm.CPU_MAX_PARAMETERS
    fm.check_feasible(_Loaded(limit), force=False)  # at the limit: allowed
    with pytest.raises(ConfigError, match="above the 300M-parameter limit for CPUs.*--force"):
        fm.check_feasible(_Loaded(limit + 1))
    fm.check_feasible(_Loaded(limit + 1), force=True)
    fm.check_feasible(_Loaded(limit + 1, device="cuda"))


def test_grpo_config_maps_the_training_knobs(tiny_loaded):
    cfg = tiny_config(beta=0.02, temperature=0.6, max_completion_length=12, scale_rewards=True, seed=5)
    settings = FullModelSettings(epochs=3, learning_rate=2e-6)
    args = fm.grpo_config(cfg.training, settings, tiny_loaded, per_step=4, output_dir="unused", progress=False)
    assert (args.num_generations, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8, 1)
    assert (args.num_train_epochs, args.learning_rate, args.beta, args.temperature) == (3, 2e-6, 0.02, 0.6)
    assert (args.max_completion_length, args.loss_type, args.scale_rewards, args.seed) == (12, "dr_grpo", "group", 5)
    assert args.lr_scheduler_type == "constant" and args.bf16 is False and args.activation_checkpointing is False


def _offline(*args: str) -> Any:
    return CliRunner().invoke(app, ["offline", "--dataset", "gsm8k", "--out", "unused", "--limit", "1", *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--full-model", "--memories-from", "."], "--memories-from evaluates another run's memories"),
        (["--ablations", "--memories-from", "."], "--memories-from evaluates another run's memories"),
        (["--full-model", "--ablations"], "two different runs"),
        (["--epochs", "2", "--save-model"], "--epochs, --save-model: only used with --full-model"),
        (["--reward", "gold"], "--reward: only used with --full-model"),
        (["--full-model", "--reward", "truth", "--preset", "cpu-tiny"], "unknown reward 'truth'"),
    ],
)
def test_bad_flags_give_one_error_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _offline(*args)
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "unused").exists()  # refused before any work


# ---- one real training run --------------------------------------------------------------------


class _Spy:
    """Records what TRL's GRPOTrainer is given (the training set) and what it hands the reward function."""

    def __init__(self) -> None:
        self.columns: list[list[str]] = []
        self.rows: list[list[dict[str, Any]]] = []
        self.reward_kwargs: list[dict[str, Any]] = []

    def trainer(self, real: type) -> type:
        spy = self

        class SpyTrainer(real):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, train_dataset: Any, **kwargs: Any):
                spy.columns.append(list(train_dataset.column_names))
                spy.rows.append(list(train_dataset))
                super().__init__(*args, train_dataset=train_dataset, **kwargs)

        return SpyTrainer

    def advantage_reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        """1 for the first rollout of each group of 2, 0 for the second: a nonzero advantage every step."""
        self.reward_kwargs.append({k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_extra")})
        return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


@pytest.fixture(scope="module")
def trained_run(tiny_loaded, tmp_path_factory):
    """One TTRL run (with the advantage reward), its model saved; the base model's digest before and after."""
    import trl

    from elm_memory.eval.full_model import run_full_model

    out = tmp_path_factory.mktemp("full") / "run"
    spy = _Spy()
    real = trl.GRPOTrainer
    before = digest(tiny_loaded.model)
    trl.GRPOTrainer = spy.trainer(real)
    try:
        with one_thread():
            result = run_full_model(
                problems(),
                tiny_config(),
                out,
                settings=FullModelSettings(epochs=1),
                dataset="custom",
                save_model=True,
                loaded=tiny_loaded,
                progress=False,
                reward_function=spy.advantage_reward,
            )
    finally:
        trl.GRPOTrainer = real
    return {"out": out, "result": result, "spy": spy, "before": before, "after": digest(tiny_loaded.model)}


@pytest.mark.model
def test_training_changes_the_whole_model_and_not_the_shared_one(trained_run, tiny_loaded):
    from transformers import AutoModelForCausalLM

    assert trained_run["before"] == trained_run["after"]  # the shared model is untouched
    trained = AutoModelForCausalLM.from_pretrained(trained_run["out"] / "model", dtype=torch.float32)
    base = dict(tiny_loaded.model.named_parameters())
    changed = {name for name, p in trained.named_parameters() if not torch.equal(p, base[name].float())}
    layers = tiny_loaded.info.num_layers
    assert all(any(f"layers.{i}." in name for name in changed) for i in range(layers))  # every layer moved
    assert len(changed) >= 0.9 * len(base)
    assert (trained_run["out"] / "model" / "model.safetensors").is_file()


@pytest.mark.model
def test_ttrl_never_sees_the_gold_answers(trained_run):
    spy = trained_run["spy"]
    assert spy.columns == [["prompt"]]
    assert spy.reward_kwargs and all(GOLD not in json.dumps(kw, default=str) for kw in spy.reward_kwargs)
    assert all(GOLD not in json.dumps(row) for row in spy.rows[0])


@pytest.mark.model
def test_the_run_directory_and_its_summary(trained_run):
    out, summary = trained_run["out"], trained_run["result"].summary
    assert summary["method"] == "TTRL" and summary["n_questions"] == 2 and summary["optimizer_steps"] == 1
    assert summary["mean_reward_first_step"] == pytest.approx(0.5)  # the advantage reward's mean
    for name in ("run.json", "zero_shot.jsonl", "full_model.jsonl", "training.json", "summary.json", "results.md"):
        assert (out / name).is_file(), name
    training = json.loads((out / "training.json").read_text())
    mapped = training["grpo_config"]
    assert (mapped["num_generations"], mapped["loss_type"], mapped["learning_rate"]) == (2, "dr_grpo", 1e-6)
    assert "| TTRL full-model accuracy (%) |" in (out / "results.md").read_text()


@pytest.mark.model
def test_a_finished_run_resumes_without_loading_or_training(trained_run, monkeypatch):
    import elm_memory.models.loading
    from elm_memory.eval.full_model import run_full_model

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a finished run must not load a model or train")

    monkeypatch.setattr(elm_memory.models.loading, "load_model", refuse)
    monkeypatch.setattr(fm, "train_full_model", refuse)
    again = run_full_model(problems(), tiny_config(), trained_run["out"], settings=FullModelSettings(epochs=1))
    assert again.summary == trained_run["result"].summary
    with pytest.raises(ConfigError, match="holds another run"):
        run_full_model(problems(), tiny_config(), trained_run["out"], settings=FullModelSettings(epochs=2))


@pytest.mark.model
def test_gold_reward_gets_the_answers_and_a_saved_model_is_reused(tiny_loaded, tmp_path, monkeypatch):
    """The gold path's training set holds the answers (TRL's trainer faked: no training); a run whose
    answers were cut short after saving its model answers with the saved model and does not train."""
    import trl

    from elm_memory.eval.full_model import run_full_model
    from elm_memory.eval.records import RecordLog

    seen: list[list[dict[str, Any]]] = []

    class FakeTrainer:
        def __init__(self, *, model: Any, train_dataset: Any, **_: Any):
            seen.append(list(train_dataset))
            self.model = model
            self.state = type("State", (), {"log_history": [{"loss": 0.0, "reward": 1.0}]})()

        def remove_callback(self, _: Any) -> None: ...

        def train(self) -> None:
            with torch.no_grad():
                self.model.get_input_embeddings().weight.add_(1e-3)  # "trained": a known change

    monkeypatch.setattr(trl, "GRPOTrainer", FakeTrainer)
    out = tmp_path / "gold"
    settings = FullModelSettings(reward="gold")
    with one_thread():
        run_full_model(problems(), tiny_config(), out, settings=settings, save_model=True, loaded=tiny_loaded)
    assert seen == [[{"prompt": seen[0][0]["prompt"], "answer": GOLD}, {"prompt": seen[0][1]["prompt"], "answer": "8"}]]
    # cut the answers short: the saved model answers the rest, nothing trains again
    log = RecordLog(out / "full_model.jsonl")
    first = log.read()[0]
    (out / "full_model.jsonl").write_text(json.dumps(first) + "\n")
    monkeypatch.setattr(fm, "train_full_model", lambda *a, **k: pytest.fail("trained again"))
    with one_thread():
        result = run_full_model(problems(), tiny_config(), out, settings=settings, loaded=tiny_loaded)
    assert [r["question_id"] for r in log.read()] == ["q1", "q2"] and result.summary["method"] == "GRPO"
