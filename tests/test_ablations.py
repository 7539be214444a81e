"""``elm offline --ablations``: the variant list, its checks, the table, and one real run of every variant
on SmolLM2-135M (cpu-tiny, 2 questions, G=2) that resumes without loading the model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _fakes import one_thread

from elm_memory.config import ELMConfig
from elm_memory.data.datasets import load_problems
from elm_memory.errors import ConfigError
from elm_memory.eval.ablations import ABLATIONS, NOT_EXPRESSIBLE, Variant, run_ablations, variant_config
from elm_memory.eval.report import markdown_ablations

COLUMNS = (
    "| variant | paper row | overrides | objective | S | zero-shot (%) | best memory (%) | mean memory (%) | "
    "oracle ZS vs Mem (%) | memories improving (%) | neg. flip top-5 (%) | IoU top-2 | learn s/memory |"
)


def tiny_config() -> ELMConfig:
    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={"generation": {"max_new_tokens": 8}, "training": {"max_completion_length": 8}},
    )


def test_the_paper_rows_are_in_the_list():
    by_name = {v.name: dict(v.overrides) for v in ABLATIONS}
    assert by_name == {
        "elm": {},
        "elm-2-steps": {"training.steps": 2},
        "elm-sft": {"training.objective": "sft"},
        "elm-lora": {"memory.kind": "lora"},
        "elm-prefix": {"memory.kind": "prefix"},
    }
    assert not any("LoRA" in row for row, _ in NOT_EXPRESSIBLE)


def test_variant_overrides_and_their_checks():
    cfg = tiny_config()
    two = variant_config(cfg, Variant("two", "x", {"training.steps": 2}))
    assert two.training.steps == 2 and two.training.num_generations == cfg.training.num_generations
    assert variant_config(cfg, Variant("sft", "x", {"training.objective": "sft"})).training.objective == "sft"
    with pytest.raises(ConfigError, match="ablation variant 'typo'.*training"):
        variant_config(cfg, Variant("typo", "x", {"training.stepz": 2}))
    with pytest.raises(ConfigError, match="variant 'other-model' changes the model section"):
        variant_config(cfg, Variant("other-model", "x", {"model.name_or_path": "packaged:qwen2.5-coder-0.5b"}))


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        ([], "no ablation variants"),
        ([Variant("a", "x"), Variant("a", "y")], "names repeat"),
        ([Variant("../up", "x")], "not a folder name"),
        ([Variant("ok", "x"), Variant("bad", "y", {"training.steps": -1})], "variant 'bad'"),
    ],
)
def test_bad_variant_lists_are_refused_before_any_work(variants, message, tmp_path):
    problems = load_problems("gsm8k", limit=1, seed=17)
    with pytest.raises(ConfigError, match=message):
        run_ablations(problems, tiny_config(), tmp_path / "run", variants=variants, progress=False)
    assert not (tmp_path / "run").exists()


def test_the_table_has_a_row_per_variant_and_the_offline_columns():
    row = {
        "variant": "elm-sft",
        "paper_row": "ELM-SFT",
        "overrides": {"training.objective": "sft"},
        "objective": "sft",
        "steps": 10,
        "n_questions": 40,
        "zero_shot_accuracy": 0.5,
        "best_memory_accuracy": 0.625,
        "mean_memory_accuracy": 0.51,
        "oracle_accuracy": 0.675,
        "fraction_improving": 0.4,
        "mean_negative_flip_rate": None,
        "top_flip": 5,
        "iou_top2": 0.55,
        "learn_seconds_mean": 12.34,
    }
    table = markdown_ablations([row, {**row, "variant": "elm"}], NOT_EXPRESSIBLE)
    lines = table.splitlines()
    assert COLUMNS in lines
    cells = "| elm-sft | ELM-SFT | training.objective=sft | sft | 10 | 50.0 | 62.5 | 51.0 | 67.5 | 40.0 | n/a | 0.550 |"
    assert f"{cells} 12.3 |" in lines
    assert sum(line.startswith("| elm") for line in lines) == 2
    assert "Not expressible as a variant:" in table


class _Counting:
    """The tiny backend, counting the greedy answers it generates without a memory (zero-shot)."""

    def __init__(self, backend: Any):
        self._backend, self.zero_shot = backend, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, prompts: Any, params: Any) -> Any:
        if params.greedy:
            self.zero_shot += sum(
                getattr(p, "soft_prompt", None) is None and getattr(p, "memory", None) is None for p in prompts
            )
        return self._backend.generate(prompts, params)


class _NoModel:
    """A backend that fails on use: a finished run must not touch the model."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a finished ablation run used the backend ({name})")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_every_variant_runs_into_its_folder_and_the_table_resumes(tiny_loaded, tiny_backend, tmp_path):
    problems = load_problems("gsm8k", limit=2, seed=17)
    out = tmp_path / "abl"
    backend = _Counting(tiny_backend)
    with one_thread():
        result = run_ablations(
            problems, tiny_config(), out, dataset="gsm8k", seed=17, backend=backend, progress=False, plots=False
        )
    assert backend.zero_shot == len(problems)  # one zero-shot pass, shared by the variants
    table = (out / "ablations.md").read_text()
    assert table == result.table and COLUMNS in table.splitlines()
    assert [r["variant"] for r in result.rows] == [v.name for v in ABLATIONS]
    assert sum(line.startswith("| elm") for line in table.splitlines()) == len(ABLATIONS)
    for variant in ABLATIONS:
        run = json.loads((out / variant.name / "run.json").read_text())
        summary = json.loads((out / variant.name / "summary.json").read_text())
        assert summary["n_memories"] == 2 and summary["n_questions"] == 2
        for dotted, value in variant.overrides.items():
            section, key = dotted.split(".")
            assert run["config"][section][key] == value  # the override reached the variant's run
    zero_shot = {v.name: (out / v.name / "zero_shot.jsonl").read_text() for v in ABLATIONS}
    assert len(set(zero_shot.values())) == 1
    rows = {r["variant"]: r for r in result.rows}
    assert (rows["elm"]["steps"], rows["elm-2-steps"]["steps"], rows["elm-sft"]["objective"]) == (1, 2, "sft")
    again = run_ablations(problems, tiny_config(), out, dataset="gsm8k", seed=17, backend=_NoModel(), plots=False)
    assert again.table == table
