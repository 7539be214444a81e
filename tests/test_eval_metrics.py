"""Evaluation metrics and reporting on hand-made records (no model, no dataset).

Every expected value below is computed by hand in the comments next to the data.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from elm_memory.eval.metrics import (
    accuracy,
    improved_set,
    iou,
    negative_flip_rate,
    oracle_accuracy,
    route_counts,
    running_accuracy,
    summarize_offline,
    summarize_online,
)
from elm_memory.eval.records import write_json_atomic
from elm_memory.eval.report import (
    markdown_offline,
    markdown_online,
    plot_offline,
    plot_online,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(
    method: str,
    index: int,
    correct: bool,
    route: str,
    answer_s: float,
    learn_s: float | None = None,
    pool_size: int = 0,
    warnings: list[str] | None = None,
) -> dict:
    timings = {"answer": answer_s}
    if learn_s is not None:
        timings["learn"] = learn_s
    return {
        "method": method,
        "index": index,
        "question_id": f"q{index}",
        "question": f"question {index}",
        "gold": "1",
        "answer": "1" if correct else ("2" if index != 1 else None),
        "correct": correct,
        "route": route,
        "memory_id": None,
        "similarity": None,
        "candidates": [],
        "timings": timings,
        "pool_size": pool_size,
        "pool_bytes": pool_size * 1_000_000,
        "warnings": warnings or [],
    }


def online_records() -> list[dict]:
    # zero_shot: correct T F T F -> 2/4; answer seconds 1+2+3+4 = 10 (mean 2.5); no learning; 1 warning.
    zero_shot = [
        _record("zero_shot", 0, True, "zero_shot", 1.0),
        _record("zero_shot", 1, False, "zero_shot", 2.0, warnings=["truncated"]),
        _record("zero_shot", 2, True, "zero_shot", 3.0),
        _record("zero_shot", 3, False, "zero_shot", 4.0),
    ]
    # elm_input (listed out of order): correct by index F T T T -> running 0, 1/2, 2/3, 3/4;
    # routes zero_shot, agree, verifier, agree; answer 10+20+30+40 = 100 (mean 25);
    # learn 5+15+missing+20 = 40 (mean 10); pool grows 1..4 entries, 4 MB at the end.
    elm = [
        _record("elm_input", 2, True, "verifier", 30.0, None, pool_size=3),
        _record("elm_input", 0, False, "zero_shot", 10.0, 5.0, pool_size=1),
        _record("elm_input", 3, True, "agree", 40.0, 20.0, pool_size=4),
        _record("elm_input", 1, True, "agree", 20.0, 15.0, pool_size=2),
    ]
    return zero_shot + elm


def elm_only() -> list[dict]:
    return [r for r in online_records() if r["method"] == "elm_input"]


# Offline study: 4 questions, zero-shot right only on q1 -> 0.25.
ZS = {"q1": True, "q2": False, "q3": False, "q4": False}
PER_MEMORY = {
    # m_b listed first: it ties m_a at 0.5, and the tie must go to the smaller id (m_a), not insertion order.
    "m_b": {"q1": True, "q2": True, "q3": False, "q4": False},  # 0.50, improves {q2}, flips: +1 -> rate 0
    "m_a": {"q1": False, "q2": True, "q3": True, "q4": False},  # 0.50, improves {q2,q3}, flips: -1 +2 -> 1/3
    "m_c": {"q1": True, "q2": False, "q3": False, "q4": False},  # 0.25, equal to zero-shot, no flips -> None
    "m_d": {"q1": False, "q2": False, "q3": False, "q4": False},  # 0.00, flips: -1 -> rate 1
}


# --- online metrics -----------------------------------------------------------------------------


def test_accuracy_and_empty():
    assert accuracy(online_records()) == 5 / 8  # 2 (zero_shot) + 3 (elm_input) of 8
    assert accuracy(elm_only()) == 0.75
    with pytest.raises(ValueError, match="empty"):
        accuracy([])


def test_accuracy_rejects_missing_or_non_bool_correct():
    bad = dict(elm_only()[0])
    del bad["correct"]
    with pytest.raises(ValueError, match="correct"):
        accuracy([bad])
    bad["correct"] = "yes"
    with pytest.raises(ValueError, match="bool"):
        accuracy([bad])


def test_running_accuracy_follows_index_order():
    assert running_accuracy(elm_only()) == pytest.approx([0.0, 0.5, 2 / 3, 0.75])
    assert running_accuracy([]) == []


def test_running_accuracy_rejects_mixed_streams():
    with pytest.raises(ValueError, match="duplicate index"):
        running_accuracy(online_records())


def test_route_counts():
    assert route_counts(elm_only()) == {"agree": 2, "verifier": 1, "zero_shot": 1}
    assert route_counts([{"route": None}, {}]) == {"unknown": 2}


def test_summarize_online_numbers():
    summary = summarize_online(online_records())
    assert list(summary) == ["zero_shot", "elm_input"]  # order of first appearance
    elm = summary["elm_input"]
    assert elm["n"] == 4 and elm["correct"] == 3 and elm["accuracy"] == 0.75
    assert elm["routes"] == {"agree": 2, "verifier": 1, "zero_shot": 1}
    assert elm["answer_seconds_total"] == 100.0 and elm["answer_seconds_mean"] == 25.0
    assert elm["learn_seconds_total"] == 40.0 and elm["learn_seconds_mean"] == 10.0
    assert elm["pool_size"] == 4 and elm["pool_bytes"] == 4_000_000  # from index 3, not the last line
    assert elm["warnings"] == 0 and elm["unanswered"] == 0
    zs = summary["zero_shot"]
    assert zs["accuracy"] == 0.5 and zs["answer_seconds_mean"] == 2.5
    assert zs["learn_seconds_total"] == 0.0 and zs["pool_size"] == 0
    assert zs["warnings"] == 1 and zs["unanswered"] == 1  # index 1 has answer None
    json.dumps(summary, allow_nan=False)  # the summary is written as JSON by the runner


def test_summarize_online_errors():
    with pytest.raises(ValueError, match="no records"):
        summarize_online([])
    with pytest.raises(ValueError, match="method"):
        summarize_online([{**elm_only()[0], "method": ""}])
    with pytest.raises(ValueError, match="duplicate index"):
        summarize_online(elm_only() + elm_only()[:1])
    with pytest.raises(ValueError, match="timings"):
        summarize_online([{**elm_only()[0], "timings": {"answer": "slow"}}])


# --- offline metrics ----------------------------------------------------------------------------


def test_negative_flip_rate():
    zs = {"q1": True, "q2": False, "q3": False, "q4": False, "q5": True}
    mem = {"q1": False, "q2": True, "q3": True, "q4": True, "q5": True, "extra": False}
    assert negative_flip_rate(zs, mem) == 0.25  # 1 negative, 3 positive flips; "extra" is ignored
    assert negative_flip_rate(zs, zs) is None  # no flips: 0/0
    assert negative_flip_rate({"q1": True}, {"q1": False}) == 1.0


def test_improved_set_and_iou():
    assert improved_set(ZS, PER_MEMORY["m_a"]) == {"q2", "q3"}
    assert improved_set(ZS, PER_MEMORY["m_d"]) == set()
    assert iou({"a", "b"}, {"b", "c"}) == pytest.approx(1 / 3)
    assert iou(set(), set()) is None
    assert iou({"a"}, set()) == 0.0
    assert iou({"a"}, {"a"}) == 1.0


def test_oracle_accuracy():
    zs = {"q1": True, "q2": False, "q3": False, "q4": False}
    mem = {"q1": False, "q2": True, "q3": False, "q4": False}
    assert oracle_accuracy(zs, mem) == 0.5  # q1 from zero-shot, q2 from the memory
    with pytest.raises(ValueError, match="overlap"):
        oracle_accuracy({"q1": True}, {"q2": True})


def test_summarize_offline_numbers():
    s = summarize_offline(ZS, PER_MEMORY)
    assert s["n_questions"] == 4 and s["n_memories"] == 4
    assert s["zero_shot_accuracy"] == 0.25
    assert s["best_memory"] == {"id": "m_a", "accuracy": 0.5}  # tie with m_b broken by id
    assert [m["id"] for m in s["memories"]] == ["m_a", "m_b", "m_c", "m_d"]
    assert s["memory_accuracy"] == {"m_a": 0.5, "m_b": 0.5, "m_c": 0.25, "m_d": 0.0}
    assert s["mean_memory_accuracy"] == 0.3125
    assert s["fraction_improving"] == 0.5  # m_a, m_b; m_c only equals zero-shot
    assert s["oracle_accuracy"] == 0.75  # ZS vs m_a: q1, q2, q3
    assert s["negative_flip_rates"]["m_a"] == pytest.approx(1 / 3)
    assert s["negative_flip_rates"]["m_b"] == 0.0
    assert s["negative_flip_rates"]["m_c"] is None
    assert s["negative_flip_rates"]["m_d"] == 1.0
    assert s["mean_negative_flip_rate"] == pytest.approx((1 / 3 + 0 + 1) / 3)  # None ignored
    assert s["iou_top2"] == 0.5  # {q2,q3} vs {q2}
    assert s["deltas"] == [0.25, 0.25, 0.0, -0.25]
    json.dumps(s, allow_nan=False)


def test_summarize_offline_top_flip_limits_the_ranked_memories():
    s = summarize_offline(ZS, PER_MEMORY, top_flip=2)
    assert list(s["negative_flip_rates"]) == ["m_a", "m_b"]
    assert s["mean_negative_flip_rate"] == pytest.approx((1 / 3 + 0) / 2)
    assert summarize_offline(ZS, PER_MEMORY, top_flip=0)["mean_negative_flip_rate"] is None


def test_summarize_offline_delta_is_paired_on_the_memorys_questions():
    # Evaluated on q2, q3 only (zero-shot 0/2 there): accuracy 1/2, delta +1/2 (not 1/2 - 1/4).
    s = summarize_offline(ZS, {"m": {"q2": True, "q3": False}})
    assert s["memories"][0]["accuracy"] == 0.5 and s["deltas"] == [0.5]
    assert s["oracle_accuracy"] == 0.5
    assert s["iou_top2"] is None  # fewer than two memories


def test_summarize_offline_without_memories():
    s = summarize_offline(ZS, {})
    assert s["zero_shot_accuracy"] == 0.25
    assert s["best_memory"] is None and s["mean_memory_accuracy"] is None
    assert s["fraction_improving"] is None and s["oracle_accuracy"] is None and s["deltas"] == []


def test_the_held_out_best_memory_is_free_of_the_winners_curse():
    import random

    from elm_memory.eval.metrics import held_out_best_memory

    rng = random.Random(3)
    questions = [f"q{i}" for i in range(20)]
    z = {q: i % 2 == 0 for i, q in enumerate(questions)}  # zero-shot right on half
    in_sample, held_out = [], []
    for _ in range(30):  # 30 studies of 40 memories that are coin flips: none carries anything
        noise = {f"m{j}": {q: rng.random() < 0.5 for q in questions} for j in range(40)}
        s = summarize_offline(z, noise)
        held = s["best_memory_held_out"]
        assert held["questions"] == 20 and held["splits"] == 1000
        in_sample.append(s["best_memory"]["accuracy"] - 0.5)
        held_out.append(held["mean_gain"])
    assert sum(in_sample) / 30 > 0.2  # the best of 40 coin flips looks 20+ points ahead of zero-shot
    assert abs(sum(held_out) / 30) < 0.04  # picked on one half, it is a coin flip on the other
    # a memory right wherever zero-shot is wrong, and right elsewhere too, is ahead on every held-out half
    better = held_out_best_memory(z, {"good": dict.fromkeys(questions, True)}, splits=50)
    assert better is not None and 0.4 < better["mean_gain"] <= 0.5 and better["share_better"] == 1.0
    same = held_out_best_memory(z, {"copy": dict(z)}, splits=50)
    assert same is not None and same["mean_gain"] == 0 and same["share_better"] == same["share_worse"] == 0
    # only the questions every memory answered count; with fewer than two there is nothing to split
    assert held_out_best_memory(z, {"a": {"q0": True, "q1": True}, "b": {"q1": True, "q2": False}}) is None
    assert held_out_best_memory(z, {}) is None


def test_summarize_offline_errors():
    with pytest.raises(ValueError, match="q5"):
        summarize_offline(ZS, {"m": {"q1": True, "q5": True}})
    with pytest.raises(ValueError, match="zs is empty"):
        summarize_offline({}, {})
    with pytest.raises(ValueError, match="no questions"):
        summarize_offline(ZS, {"m": {}})
    with pytest.raises(ValueError, match="top_flip"):
        summarize_offline(ZS, PER_MEMORY, top_flip=-1)
    with pytest.raises(ValueError, match="bool"):
        summarize_offline({"q1": None}, {})


# --- Markdown -----------------------------------------------------------------------------------


def test_markdown_online_rows():
    table = markdown_online(summarize_online(online_records()))
    lines = table.strip().splitlines()
    assert lines[0] == (
        "| method | n | accuracy (%) | its zero-shot (%) | gains/losses | zero_shot | agree | verifier | answer s/q "
        "| learn s/q | pool size | pool MB |"
    )
    assert lines[2] == "| zero_shot | 4 | 50.0 | n/a | n/a | 4 | 0 | 0 | 2.5 | 0.0 | 0 | 0.00 |"
    assert lines[3] == "| elm_input | 4 | 75.0 | n/a | n/a | 1 | 2 | 1 | 25.0 | 10.0 | 4 | 4.00 |"
    assert len(lines) == 4
    with pytest.raises(ValueError):
        markdown_online({})


def test_markdown_offline_rows():
    table = markdown_offline(summarize_offline(ZS, PER_MEMORY))
    assert "| zero-shot accuracy (%) | 25.0 |" in table
    assert "| best memory accuracy (%) | 50.0 (m_a) |" in table
    assert "| mean memory accuracy (%) | 31.2 |" in table  # 31.25 rounds half-to-even
    assert "| oracle ZS vs Mem accuracy (%) | 75.0 |" in table
    assert "| memories improving on zero-shot (%) | 50.0 |" in table
    assert "| mean negative flip rate, top-5 (%) | 44.4 |" in table  # 4/9
    assert "| IoU of improved questions, top-2 | 0.500 |" in table
    empty = markdown_offline(summarize_offline(ZS, {}))
    assert "| best memory accuracy (%) | n/a |" in empty and "| IoU of improved questions, top-2 | n/a |" in empty


# --- figures and files --------------------------------------------------------------------------


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path


def test_plot_online_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot_online(online_records(), tmp_path / "figs")
    assert [p.name for p in paths] == ["accuracy_over_stream.png", "routes.png", "pool_growth.png"]
    for path in paths:
        _assert_png(path)
    # Without any pool there is no pool-growth figure.
    no_pool = plot_online([r for r in online_records() if r["method"] == "zero_shot"], tmp_path / "zs")
    assert [p.name for p in no_pool] == ["accuracy_over_stream.png", "routes.png"]
    with pytest.raises(ValueError):
        plot_online([], tmp_path)


def test_the_accuracy_plot_draws_the_paired_curves_beside_the_methods(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn: list[tuple[str, str]] = []
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("linestyle", "-")))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    curve = [{"index": 1, "correct": True}, {"index": 0, "correct": False}]
    paths = plot_online(online_records(), tmp_path, {"elm_input: self-consistency": curve})
    _assert_png(paths[0])
    assert ("elm_input: self-consistency", "--") in drawn
    assert {label for label, style in drawn if style == "-"} >= {"zero_shot", "elm_input"}


def test_plot_offline_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot_offline(summarize_offline(ZS, PER_MEMORY), tmp_path)
    assert [p.name for p in paths] == ["memory_deltas.png", "memory_accuracy.png"]
    for path in paths:
        _assert_png(path)
    assert plot_offline(summarize_offline(ZS, {}), tmp_path / "none") == []
    single = plot_offline(summarize_offline(ZS, {"m": PER_MEMORY["m_a"]}), tmp_path / "single")  # one delta value
    for path in single:
        _assert_png(path)


def test_importing_report_does_not_import_matplotlib():
    code = "import sys, elm_memory.eval.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_write_json_is_atomic_and_round_trips(tmp_path):
    target = tmp_path / "out" / "summary.json"
    write_json_atomic(target, {"a": 1, "b": [None, 0.5]})
    assert json.loads(target.read_text()) == {"a": 1, "b": [None, 0.5]}
    with pytest.raises(ValueError):
        write_json_atomic(target, {"a": math.nan})
    assert json.loads(target.read_text()) == {"a": 1, "b": [None, 0.5]}  # old file intact
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]  # no temp files left


def test_zero_shot_candidate_gains_and_losses():
    # final F T T T; zero-shot candidate F F T T... by index: q0 F/F, q1 T/F (gain), q2 T/T, q3 T/F (gain)
    # plus one loss: make q2's candidate right and the final wrong.
    elm = elm_only()
    zs_by_index = {0: False, 1: False, 2: True, 3: False}
    for r in elm:
        r["candidates"] = [
            {"kind": "zero_shot", "answer": "x", "correct": zs_by_index[r["index"]]},
            {"kind": "memory", "answer": "y", "correct": True},
        ]
    for r in elm:
        if r["index"] == 2:
            r["correct"] = False
    s = summarize_online(elm)["elm_input"]
    assert s["zero_shot_candidate_accuracy"] == 0.25
    assert (s["gains"], s["losses"]) == (2, 1)
    line = markdown_online({"elm_input": s}).strip().splitlines()[2]
    assert line.startswith("| elm_input | 4 | 50.0 | 25.0 | +2/-1 |")
    # one record without a zero-shot candidate: not available rather than a partial number
    elm[0]["candidates"] = []
    assert summarize_online(elm)["elm_input"]["zero_shot_candidate_accuracy"] is None
