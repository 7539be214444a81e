"""Every benchmark runs as ``python -m benchmarks.NAME`` (``--help`` answers) and none edits ``sys.path``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_benchmarks_is_a_package_with_modules():
    assert (ROOT / "benchmarks" / "__init__.py").is_file()
    assert len(MODULES) >= 20  # a glob that found nothing would make the tests below vacuous


@pytest.mark.parametrize("name", MODULES)
def test_help_runs_as_a_module(name):
    # from the repository root, as the docs say; PYTHONPATH makes this checkout's elm_memory the one imported
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"python -m benchmarks.{name} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("name", MODULES)
def test_no_sys_path_edits(name):
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    edits = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]
    assert not edits, f"benchmarks/{name}.py uses sys.path on line(s) {edits}: import through the package instead"


def test_model_candidates_summary_counts_agreement_and_cost():
    from benchmarks.model_candidates import markdown, summarize

    def row(right, shares, majority_right, learn_s, tokens):
        pairs = zip(shares, majority_right, strict=True)
        steps = [{"share": s, "boxed": 1.0 if s else 0.5, "majority_right": m} for s, m in pairs]
        return {"greedy_right": right, "greedy_s": 2.0, "greedy_tokens": 10, "learn_s": learn_s,
                "rollout_tokens": tokens, "steps": steps}  # fmt: skip

    s = summarize([row(True, [1.0, 0.5], [True, True], 8.0, 80), row(False, [0.25], [False], 4.0, 40)])
    assert s["questions"] == 2 and s["zero_shot_right"] == 1 and s["steps"] == 3
    assert s["mean_majority_share"] == round(1.75 / 3, 3)
    assert s["steps_share_at_least_half"] == 2 and s["steps_unanimous"] == 1 and s["pseudo_label_right"] == 2
    assert s["learn_s_per_step"] == 4.0 and s["rollout_tokens_per_s"] == 10.0 and s["greedy_tokens_per_s"] == 5.0
    table = markdown([{"model": "/x/q15.gguf", "peak_rss_gib": 1.5, "summary": s}])
    assert "| q15.gguf | 1/2 | 0.583 | 2/3 | 1/3 |" in table


@pytest.mark.parametrize("tied", [False, True])
def test_the_decode_roofline_counts_the_weights_a_step_reads(tied):
    """An untied input embedding table is gathered one row per sequence, not read whole: it stays out of
    the decode floor; a tied one is the output layer and stays in."""
    import torch
    from _fakes import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    from benchmarks.learn_throughput import decode_params, roofline_tok_s

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(1000, 64, tie_word_embeddings=tied))
    total = sum(p.numel() for p in model.parameters())
    assert decode_params(model) == (total if tied else total - 1000 * model.config.hidden_size)
    machine = {"read_bandwidth_gb_s": 1.0, "gemm_gflop_s": {"bfloat16": 1e6}}
    roof = roofline_tok_s(machine, decode_params(model), "bfloat16", 1)
    assert roof["bound"] == "memory" and roof["step_ms"] == round(decode_params(model) * 2 / 1e9 * 1e3, 1)


def test_answer_rows_ratios_take_each_engines_better_round_and_null_an_absent_engine():
    from benchmarks.answer_rows import summarize

    def cell(rows, memory, engine, ms):
        return {"rows": rows, "memory": memory, "engine": engine, "ms_per_step": ms}

    cells = [
        cell(1, "soft_prompt", "plain", 50.0),
        cell(1, "soft_prompt", "int4", 40.0),
        cell(1, "soft_prompt", "plain", 52.0),  # the better round counts
        cell(1, "soft_prompt", "int4", 25.0),
        cell(2, "soft_prompt", "plain", 60.0),
        cell(2, "soft_prompt", "int4", 40.0),
        cell(1, "lora", "plain", 70.0),
        cell(1, "lora", "int4", 35.0),
    ]
    s = summarize(cells, ["plain", "int4"])
    assert (s["ratio_1row_int4"], s["ratio_2row_int4"]) == (2.0, 1.5)  # the soft-prompt cases
    assert s["ratio_1row_llama"] is None and s["ratio_2row_llama"] is None  # llama.cpp absent: null
    assert s["ratios"]["1row_lora"] == {"int4": 2.0}
    assert s["ms_per_step"]["1row_soft_prompt"] == {"plain": 50.0, "int4": 25.0}


def test_amortized_readings_recount_a_committed_readout():
    from benchmarks.amortized_readings import load, readings

    run = ROOT / "benchmarks" / "results" / "amortized_evidence" / "synth-arith_89"
    records = load(run)
    assert len(records) == 200
    assert "\n".join(readings(records)) + "\n" == (run / "readings.txt").read_text(encoding="utf-8")


def _pooled(**values):
    base = {"wins": 10, "losses": 2, "p": 0.04, "token_share": 0.3, "gain_recovered": 0.8, "gate_extra_share": 0.05}
    base.update(zero_shot=0.40, self_consistency=0.50, elm_amortized=0.48, seeds=[89, 97], answers=200)
    base.update(values)
    base.update(gain=base["elm_amortized"] - base["zero_shot"], vote_lead=base["self_consistency"] - base["zero_shot"])
    return base


def test_amortized_targets_hold_each_stream_to_the_plans_thresholds():
    from benchmarks.amortized_targets import markdown, verdict

    met = verdict({"a": _pooled(), "b": _pooled(elm_amortized=0.42, gain_recovered=0.2, p=0.5)})
    first, floor, gate = met["targets"]
    assert first["streams"] == {"a": True, "b": False} and first["met"]  # one stream is enough for the first
    assert floor["met"] and gate["met"] and not met["third_stream_planned"]  # a's vote leads by 10 points
    assert "**yes**" in markdown(met)
    # each threshold alone fails the first target; the floor and the gate fail on any one stream
    for miss in (
        {"elm_amortized": 0.449},
        {"p": 0.05},
        {"token_share": 0.41},
        {"gain_recovered": 0.59},
        {"gain_recovered": None},
    ):
        assert not verdict({"a": _pooled(**miss)})["targets"][0]["met"], miss
    behind = verdict({"a": _pooled(), "b": _pooled(wins=3, losses=4, self_consistency=0.45)})
    assert not behind["targets"][1]["met"] and behind["targets"][1]["streams"]["a"]
    assert not verdict({"a": _pooled(gate_extra_share=0.16)})["targets"][2]["met"]
    assert verdict({"a": _pooled(self_consistency=0.479)})["third_stream_planned"]  # 7.9 points < 8


def test_amortized_targets_read_runs_through_elm_compare(tmp_path):
    from test_seeds import make_amortized_run

    from benchmarks.amortized_targets import plot, stream_readings, verdict

    # test halves: zero-shot right on 1 of 4, the vote and ELM amortized (serving the vote) on 4 of 4
    a = make_amortized_run(tmp_path, 1, ["a", "x", "b", "c"], ["1", "1", "1", "2"], ["1"] * 4, ["1"] * 4)
    b = make_amortized_run(tmp_path, 2, ["d", "y", "e", "f"], ["2", "1", "2", "2"], ["1"] * 4, ["1"] * 4)
    s = stream_readings([a, b])
    assert (s["answers"], s["wins"], s["losses"], s["seeds"]) == (4, 3, 0, [1, 2])
    assert s["gain"] == pytest.approx(0.75) and s["gain_recovered"] == pytest.approx(1.0)
    result = verdict({"synth-arith": s})
    # p = 0.25 with 3 wins, and 300 tokens against the vote's 250: the first target fails; the gate's 50 of 300 too
    assert [t["met"] for t in result["targets"]] == [False, True, False]
    assert s["rows"]["self_consistency"] == {"accuracy": 1.0, "tokens": 250.0}
    png = plot(result, tmp_path / "accuracy_tokens.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paired_runs_counts_each_row_on_the_questions_both_runs_answered(tmp_path, capsys):
    from test_seeds import make_amortized_run

    from benchmarks.paired_runs import main, paired_runs

    # A (seed 1) and B (seed 2) share b, c, d; e is B's alone. The vote: A right on b only, B on c and d.
    a = make_amortized_run(tmp_path, 1, ["a", "b", "c", "d"], ["1", "1", "2", "2"], ["1", "1", "2", "2"], ["1"] * 4)
    b = make_amortized_run(tmp_path, 2, ["d", "c", "b", "e"], ["2", "2", "1", "1"], ["1", "1", "2", "1"], ["1"] * 4)
    result = paired_runs(a, b)
    assert result["questions"] == 3
    vote = result["rows"]["self_consistency"]
    assert (vote["right_a"], vote["right_b"], vote["b_only"], vote["a_only"]) == (1, 2, 2, 1)
    assert vote["p"] == pytest.approx(1.0) and vote["tokens_b"] == 250.0
    assert result["rows"]["zero_shot"]["b_only"] == result["rows"]["zero_shot"]["a_only"] == 0
    assert paired_runs(a, b, first=1)["rows"]["self_consistency"]["a_only"] == 1  # b, A's first shared question
    assert result["seconds_a"] == {"answer": 1.0, "learn": 0.0}
    main([str(a), str(b)])
    assert "| self_consistency | 1 (33.3%) | 2 (66.7%) | 2 / 1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main([str(a), str(tmp_path)])
    assert refused.value.code == 2 and "no records.jsonl" in capsys.readouterr().err
