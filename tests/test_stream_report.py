"""Reading stream-memory records: rows graded against gold, the planned sign tests on the test part, pooling
over runs by distinct question, the history of versions and rollbacks, and the plot (no model)."""

from __future__ import annotations

import pytest

from elm_memory.eval.stream_report import markdown_stream, plot_stream, stream_history, summarize_stream


def _record(index, gold, rows, qid=None, rolled_back=False):
    return {
        "method": "elm_stream",
        "index": index,
        "question_id": qid or f"q{index}",
        "gold": gold,
        "extra": {
            "stream": {
                "rows": rows,
                "updates": {
                    "grpo": {
                        "version_used": index,
                        "version": index + 1,
                        "applied": not rolled_back,
                        "skipped": "rolled_back" if rolled_back else None,
                    }
                },
            }
        },
    }


def _rows(zero, sc, fmt, init, greedy, vote):
    return {
        "zero_shot": zero,
        "self_consistency": sc,
        "format": fmt,
        "init_greedy": init,
        "stream_greedy[grpo]": greedy,
        "stream_vote[grpo]": vote,
    }


def test_rows_are_graded_against_gold_and_tested_on_the_test_part_only():
    records = [
        _record(0, "1", _rows("1", "1", "1", "1", "9", "9")),  # warm-up: the stream is wrong, not counted in test
        _record(1, "2", _rows("9", "2", "9", "9", "2", "2")),
        _record(2, "3", _rows("9", "3", "3", "9", "3", "3")),
        _record(3, "4", _rows("4", "9", "4", "4", "4", "4")),
    ]
    s = summarize_stream([records], warmup=1)
    test, whole = s["parts"]["test"], s["parts"]["all"]
    assert s["arms"] == ["grpo"] and test["answers"] == 3 and whole["answers"] == 4
    assert test["accuracy"]["stream_greedy[grpo]"] == 1.0 and whole["accuracy"]["stream_greedy[grpo]"] == 0.75
    assert test["accuracy"]["zero_shot"] == 1 / 3
    by = {(t["row"], t["baseline"]): (t["wins"], t["losses"]) for t in test["tests"]}
    assert by[("stream_greedy[grpo]", "zero_shot")] == (2, 0)
    assert by[("stream_vote[grpo]", "self_consistency")] == (1, 0)
    assert by[("stream_greedy[grpo]", "format")] == (1, 0)
    assert "| stream_greedy[grpo] | zero_shot | 2 | 0 |" in markdown_stream(s)
    # "no answer": a row without a boxed answer (None), per part
    unboxed = [
        _record(4, "5", _rows(None, "5", None, None, "5", "5")),
        _record(5, "6", _rows("6", "6", "6", "6", "6", "6")),
    ]
    u = summarize_stream([records + unboxed], warmup=1)["parts"]["test"]["unboxed"]
    assert u["zero_shot"] == 1 / 5 and u["stream_greedy[grpo]"] == 0.0
    assert "| zero_shot | 40.0% | 50.0% | 20.0% | 16.7% |" in markdown_stream(
        summarize_stream([records + unboxed], warmup=1)
    )


def test_a_question_in_two_runs_counts_once_in_a_sign_test():
    a = [_record(0, "1", _rows("9", "1", "1", "1", "1", "1"), qid="same")]
    b = [_record(0, "1", _rows("9", "1", "1", "1", "1", "1"), qid="same")]
    s = summarize_stream([a, b], warmup=0)
    [zero] = [t for t in s["parts"]["test"]["tests"] if t["baseline"] == "zero_shot"]
    assert (zero["wins"], zero["losses"]) == (1, 0) and s["parts"]["test"]["answers"] == 2


def test_history_and_plot_mark_rollbacks(tmp_path):
    records = [
        _record(0, "1", _rows("1", "1", "1", "1", "1", "1")),
        _record(1, "2", _rows("2", "2", "2", "2", "9", "2"), rolled_back=True),
    ]
    [_, second] = stream_history(records)["grpo"]
    assert second["skipped"] == "rolled_back" and second["version_used"] == 1
    path = plot_stream(records, tmp_path, warmup=1)
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_stream([{"method": "zero_shot", "extra": {}}], tmp_path, warmup=0) is None


def test_the_zero_shot_vote_row_is_tested_against_self_consistency_only_when_recorded():
    rows = _rows("1", "9", "1", "1", "1", "9")
    plain = summarize_stream([[_record(0, "1", rows)]], warmup=0)
    assert all(t["row"] != "stream_zs_vote[grpo]" for t in plain["parts"]["test"]["tests"])
    with_zs = summarize_stream([[_record(0, "1", {**rows, "stream_zs_vote[grpo]": "1"})]], warmup=0)
    by = {(t["row"], t["baseline"]): (t["wins"], t["losses"]) for t in with_zs["parts"]["test"]["tests"]}
    assert by[("stream_zs_vote[grpo]", "self_consistency")] == (1, 0)


def test_each_run_keeps_its_own_warm_up_when_pooled():
    # run a stopped after 2 questions (warm-up 1), run b ran 4 (warm-up 2): each run's own second half is tested
    a = [_record(i, "1", _rows("9", "1", "1", "1", "1", "1"), qid=f"a{i}") for i in range(2)]
    b = [_record(i, "1", _rows("9", "1", "1", "1", "1", "1"), qid=f"b{i}") for i in range(4)]
    s = summarize_stream([a, b], warmup=[1, 2])
    assert s["parts"]["test"]["answers"] == 1 + 2 and s["warmup"] == [1, 2]
    [zero] = [t for t in s["parts"]["test"]["tests"] if t["baseline"] == "zero_shot"]
    assert (zero["wins"], zero["losses"]) == (3, 0)
    assert "after the first 1, 2 of each run" in markdown_stream(s)
    with pytest.raises(ValueError, match="2 warm-up lengths for 1 runs"):
        summarize_stream([a], warmup=[1, 2])
