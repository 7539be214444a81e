"""`elm compare`: mean and spread over online runs that differ only in their seed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elm_memory.cli import app
from elm_memory.errors import ConfigError
from elm_memory.eval.seeds import compare_seeds, markdown_seeds

CONFIG = {"training": {"steps": 1, "num_generations": 4}, "retrieval": {"key": "input"}}


def make_run(root: Path, seed: int, zero_shot: list[bool], elm: list[tuple[bool, bool]], **manifest) -> Path:
    """A run directory as `elm stream` writes it; ``elm`` holds (final correct, its zero-shot candidate correct)."""
    out = root / f"s{seed}"
    out.mkdir()
    ids = [f"q{i}" for i in range(len(zero_shot))]
    (out / "run.json").write_text(
        json.dumps({"dataset": "synth-arith", "seed": seed, "question_ids": ids, "config": CONFIG, **manifest})
    )
    lines = []
    for i, ok in enumerate(zero_shot):
        lines.append({"method": "zero_shot", "index": i, "question_id": ids[i], "correct": ok, "route": "zero_shot"})
    for i, (ok, zs_ok) in enumerate(elm):
        cands = [{"kind": "zero_shot", "correct": zs_ok}, {"kind": "memory", "correct": ok}]
        lines.append(
            {
                "method": "elm_input",
                "index": i,
                "question_id": ids[i],
                "correct": ok,
                "route": "verifier",
                "candidates": cands,
            }
        )
    for r in lines:
        r.update(timings={"answer": 1.0, "learn": 0.0}, pool_size=0, pool_bytes=0, warnings=[])
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def test_mean_spread_and_gains_over_seeds(tmp_path):
    a = make_run(tmp_path, 17, [True, False, True, False], [(True, True), (True, False), (True, True), (False, False)])
    b = make_run(
        tmp_path, 42, [True, True, False, False], [(False, True), (True, True), (False, False), (False, False)]
    )
    c = compare_seeds([a, b])
    elm = c.methods["elm_input"]
    assert elm["seeds"] == [17, 42]
    assert elm["accuracy"] == [0.75, 0.25]
    assert elm["mean"] == pytest.approx(0.5)
    assert elm["std"] == pytest.approx(statistics.stdev([0.75, 0.25]))
    assert elm["delta_vs_zero_shot"] == pytest.approx([0.25, -0.25])
    assert (elm["total_gains"], elm["total_losses"]) == (1, 1)  # seed 17 q1 gained, seed 42 q0 lost
    table = markdown_seeds(c)
    assert "| elm_input | 75.0 | 25.0 | 50.0 |" in table
    assert "+1/−1" in table


def test_refuses_runs_that_are_not_comparable(tmp_path):
    a = make_run(tmp_path, 17, [True, False], [(True, True), (False, False)])
    other_config = dict(CONFIG, training={"steps": 10, "num_generations": 4})
    b = make_run(tmp_path, 42, [True, False], [(True, True), (False, False)], config=other_config)
    with pytest.raises(ConfigError, match="training.steps"):
        compare_seeds([a, b])
    same_seed = tmp_path / "again"
    same_seed.mkdir()
    (same_seed / "run.json").write_text((a / "run.json").read_text())
    (same_seed / "records.jsonl").write_text((a / "records.jsonl").read_text())
    with pytest.raises(ConfigError, match="same seed"):
        compare_seeds([a, same_seed])
    with pytest.raises(ConfigError, match="at least two"):
        compare_seeds([a])
    with pytest.raises(ConfigError, match="no run.json"):
        compare_seeds([a, tmp_path / "missing"])


def test_partial_run_is_refused_unless_asked(tmp_path):
    a = make_run(tmp_path, 17, [True, False, True], [(True, True), (False, False), (True, True)])
    b = make_run(tmp_path, 42, [True, False, True], [(True, True)])  # elm_input stopped after one question
    with pytest.raises(ConfigError, match="elm_input answers for 1 of its 3"):
        compare_seeds([a, b])
    c = compare_seeds([a, b], partial=True)
    assert c.methods["elm_input"]["n"] == [3, 1]
    first = compare_seeds([a, b], first=1)  # both runs' first question only: comparable, no --partial needed
    assert first.methods["elm_input"]["n"] == [1, 1]
    assert first.methods["zero_shot"]["accuracy"] == [1.0, 1.0]
    with pytest.raises(ConfigError, match="fewer than the first 4"):
        compare_seeds([a, b], first=4)


def test_cli_prints_and_writes(tmp_path):
    a = make_run(tmp_path, 17, [True, False], [(True, False), (False, False)])
    b = make_run(tmp_path, 78, [False, False], [(True, True), (False, False)])
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / "seeds.json")])
    assert result.exit_code == 0, result.output
    assert "seed 78 (%)" in result.output
    saved = json.loads((tmp_path / "seeds.json").read_text())
    assert saved["methods"]["zero_shot"]["accuracy"] == [0.5, 0.0]
    bad = CliRunner().invoke(app, ["compare", str(a)])
    assert bad.exit_code != 0
    assert "at least two" in bad.output


def test_report_prints_a_partial_runs_table_and_refuses_a_directory_that_is_no_run(tmp_path):
    a = make_run(tmp_path, 17, [True, False, True], [(True, True)])  # elm_input stopped after one question
    result = CliRunner().invoke(app, ["report", str(a), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "partial run: elm_input 1/3 questions answered" in result.output
    assert "| zero_shot | 3 |" in result.output and "| elm_input | 1 |" in result.output
    assert json.loads((a / "summary.json").read_text())["zero_shot"]["n"] == 3
    bad = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code != 0 and "not an online run directory" in bad.output
    assert "code version" not in result.output  # one clean version (here: none recorded) is not worth a line
    assert "pace" not in result.output  # records without their times give none
    records = (a / "records.jsonl").read_text().splitlines()
    timed = [{**json.loads(r), "finished_at": 1000.0 + 60 * i} for i, r in enumerate(records)]
    (a / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timed))
    again = CliRunner().invoke(app, ["report", str(a), "--no-plots"])
    assert "elm_input 1/3 questions answered; about 2.0 min more at the pace of its last records" in again.output
    one = {"version": "0.1.0", "commit": "aaaaaaa1", "dirty": False}
    shown = {}
    for name, codes in (
        ("one", [one]),
        ("two", [one, {**one, "commit": "bbbbbbb2"}]),
        ("dirty", [{**one, "dirty": True}]),
    ):
        manifest = json.loads((a / "run.json").read_text())
        (a / "run.json").write_text(json.dumps({**manifest, "code_versions": codes}))
        shown[name] = CliRunner().invoke(app, ["report", str(a), "--no-plots"]).output
    assert "more than one code version" not in shown["one"]
    assert (
        "more than one code version or from uncommitted code: 0.1.0, commit aaaaaaa; 0.1.0, commit bbbbbbb"
        in (shown["two"])
    )
    assert "(uncommitted changes)" in shown["dirty"]


def make_stream_run(
    root: Path,
    seed: int,
    golds: list[str],
    greedy: list[str],
    answered: int | None = None,
    ids: list[str] | None = None,
) -> Path:
    """An `elm_stream` run: zero-shot always wrong ("0"), the stream memory's greedy answer as given."""
    out = root / f"stream{seed}"
    out.mkdir()
    ids = ids or [f"s{seed}-q{i}" for i in range(len(golds))]
    (out / "run.json").write_text(
        json.dumps({"dataset": "synth-arith", "seed": seed, "question_ids": ids, "config": CONFIG})
    )
    lines = []
    for i in range(len(golds) if answered is None else answered):
        rows = {
            "zero_shot": "0",
            "self_consistency": "0",
            "format": "0",
            "init_greedy": "0",
            "stream_greedy[sft]": greedy[i],
            "stream_vote[sft]": greedy[i],
        }
        lines.append(
            {
                "method": "elm_stream",
                "index": i,
                "question_id": ids[i],
                "gold": golds[i],
                "correct": greedy[i] == golds[i],
                "route": "vote",
                "extra": {"stream": {"rows": rows, "updates": {}}},
                "timings": {"answer": 1.0, "learn": 0.0},
                "pool_size": 0,
                "pool_bytes": 0,
                "warnings": [],
            }
        )
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def test_stream_runs_are_pooled_over_each_runs_second_half(tmp_path):
    # seed 1: 4 questions, right only in the warm-up; seed 2 stopped after 2 of 4, right on its second
    a = make_stream_run(tmp_path, 1, ["1", "2", "3", "4"], ["1", "2", "9", "9"])
    b = make_stream_run(tmp_path, 2, ["1", "2", "3", "4"], ["9", "2", "3", "4"], answered=2)
    with pytest.raises(ConfigError, match="elm_stream answers for 2 of its 4"):
        compare_seeds([a, b])
    c = compare_seeds([a, b], partial=True)
    assert c.stream is not None and c.stream["warmup"] == [2, 1]
    test = c.stream["parts"]["test"]
    assert test["answers"] == 2 + 1
    assert test["accuracy"]["stream_greedy[sft]"] == pytest.approx(1 / 3)
    [zero] = [t for t in test["tests"] if t["row"] == "stream_greedy[sft]" and t["baseline"] == "zero_shot"]
    assert (zero["wins"], zero["losses"]) == (1, 0)
    assert "Stream memory rows (2 run(s)" in markdown_seeds(c) and c.to_json()["stream"] == c.stream
    # the runs' code: one clean version says nothing, two are named
    for run, commit in ((a, "aaaaaaa1"), (b, "bbbbbbb2")):
        manifest = json.loads((run / "run.json").read_text())
        code = {"version": "0.1.0", "commit": commit, "dirty": False}
        (run / "run.json").write_text(json.dumps({**manifest, "code_versions": [code]}))
    mixed = compare_seeds([a, b], partial=True)
    assert mixed.to_json()["runs"][1]["code_versions"][0]["commit"] == "bbbbbbb2"
    assert "more than one code version" in markdown_seeds(mixed) and "commit bbbbbbb" in markdown_seeds(mixed)
    plain = compare_seeds(
        [make_run(tmp_path, 17, [True], [(True, True)]), make_run(tmp_path, 42, [True], [(True, True)])]
    )
    assert plain.stream is None and "stream" not in plain.to_json()


def test_a_question_two_seeds_share_counts_once_in_the_pooled_stream_tests(tmp_path):
    # both seeds ask "shared" in their test half and win it over zero-shot: two answers, one win
    a = make_stream_run(tmp_path, 1, ["1", "2"], ["9", "2"], ids=["a0", "shared"])
    b = make_stream_run(tmp_path, 2, ["1", "2"], ["9", "2"], ids=["b0", "shared"])
    test = compare_seeds([a, b]).stream["parts"]["test"]
    [zero] = [t for t in test["tests"] if t["row"] == "stream_greedy[sft]" and t["baseline"] == "zero_shot"]
    assert test["answers"] == 2 and (zero["wins"], zero["losses"]) == (1, 0)


def make_amortized_run(
    root: Path, seed: int, ids: list[str], zero: list[str], sc: list[str], served: list[str]
) -> Path:
    """An `elm stream -m elm_amortized` run: gold is "1" everywhere; ``served`` is what ELM amortized answered (the
    vote, 50 tokens a row, while the gate was shut)."""
    out = root / f"amortized{seed}"
    out.mkdir()
    (out / "run.json").write_text(
        json.dumps({"dataset": "synth-arith", "seed": seed, "question_ids": ids, "config": CONFIG})
    )
    lines = []
    for i, qid in enumerate(ids):
        rows = {"zero_shot": zero[i], "self_consistency": sc[i], "stream_greedy": zero[i], "elm_amortized": served[i]}
        tokens = {"zero_shot": 50, "self_consistency": 250, "stream_greedy": 50, "elm_amortized": 300}
        amortized = {
            "rows": rows,
            "tokens": tokens,
            "turn": {"mode": "self_consistency"},
            "samples": [sc[i]] * 4,
            "vote_share": 1.0,
            "init_is_zero_shot": True,
            "gate_extra_tokens": 50,
        }
        lines.append(
            {
                "method": "elm_amortized",
                "index": i,
                "question_id": qid,
                "gold": "1",
                "answer": served[i],
                "correct": served[i] == "1",
                "route": "self_consistency",
                "extra": {"amortized": amortized},
                "timings": {"answer": 1.0, "learn": 0.0},
                "pool_size": 1,
                "pool_bytes": 0,
                "warnings": [],
            }
        )
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def test_amortized_runs_are_pooled_over_each_runs_second_half_with_a_shared_question_counted_once(tmp_path):
    # test halves: seed 1 asks b and "shared", seed 2 asks d and "shared"; self-consistency wins "shared" in both
    a = make_amortized_run(
        tmp_path, 1, ["a", "x", "b", "shared"], ["1", "1", "1", "2"], ["1", "1", "1", "1"], ["1"] * 4
    )
    b = make_amortized_run(
        tmp_path, 2, ["c", "y", "d", "shared"], ["2", "1", "2", "2"], ["2", "1", "1", "1"], ["1"] * 4
    )
    c = compare_seeds([a, b])
    assert c.amortized is not None and c.amortized["warmup"] == [2, 2]
    test = c.amortized["parts"]["test"]
    assert test["answers"] == 4
    assert test["accuracy"]["zero_shot"] == pytest.approx(1 / 4) and test["accuracy"]["self_consistency"] == 1.0
    [elm] = [t for t in test["tests"] if t["row"] == "elm_amortized" and t["baseline"] == "zero_shot"]
    assert (elm["wins"], elm["losses"]) == (2, 0)  # d, and "shared" once for its two answers
    assert test["gate_extra_share"] == pytest.approx(50 / 300) and test["token_share"] == pytest.approx(300 / 250)
    table = markdown_seeds(c)
    assert "Amortized stream memory" in table and c.to_json()["amortized"] == c.amortized
    plain = compare_seeds(
        [make_run(tmp_path, 17, [True], [(True, True)]), make_run(tmp_path, 42, [True], [(True, True)])]
    )
    assert plain.amortized is None and "amortized" not in plain.to_json()
