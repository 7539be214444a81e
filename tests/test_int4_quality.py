"""``benchmarks.int4_quality``'s reading of two engines' zero-shot records (#66's ±2-point bar); no model."""

from __future__ import annotations

import json

import pytest

from benchmarks.int4_quality import compare, first_divergence, read_records


def _record(qid: str, correct: bool, tokens: list[int], answer: str = "1") -> dict:
    return {
        "method": "zero_shot",
        "question_id": qid,
        "correct": correct,
        "answer": answer,
        "response": f"... \\boxed{{{answer}}}",
        "batched": 1,
        "extra": {"generation": {"token_ids": tokens, "finish_reason": "stop"}},
    }


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0)],
)
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected


def test_compare_pairs_questions_and_applies_the_bar():
    plain = [_record(f"q{i}", i < 50, [1, 2, 3]) for i in range(100)]
    int4 = [_record(f"q{i}", i < 50, [1, 2, 3]) for i in range(100)]
    int4[0] = _record("q0", False, [1, 7, 3], answer="2")  # a loss that diverged at token 1
    int4[60] = _record("q60", True, [1, 2, 3, 4])  # a win whose tokens ran one longer
    int4[70] = _record("q70", True, [1, 2, 3])
    int4[80] = _record("q80", True, [1, 2, 3])
    reading = compare(plain, int4 + [_record("only-int4", True, [1])])
    assert reading["questions"] == 100  # the question only one engine answered is left out
    assert reading["plain"]["accuracy"] == 50.0 and reading["int4"]["accuracy"] == 52.0
    assert reading["minus_plain_points"] == 2.0 and reading["within_bar"]
    assert reading["paired"]["wins"] == 3 and reading["paired"]["losses"] == 1
    assert reading["same_answer"] == 99 and reading["same_tokens"] == 98
    assert reading["first_divergence"]["positions"] == [1, 3]
    int4[90] = _record("q90", True, [1, 2, 3])
    assert not compare(plain, int4)["within_bar"]  # 3 points up is outside the bar too
    llama = compare(plain, int4, engine="llama")  # any engine, under its own name
    assert llama["llama"]["accuracy"] == 53.0 and "int4" not in llama


def test_compare_with_nothing_shared_and_reading_a_missing_run(tmp_path):
    assert compare([], [_record("q", True, [1])]) == {"questions": 0}
    assert read_records(tmp_path / "absent") == []
    (tmp_path / "records.jsonl").write_text(json.dumps(_record("q", True, [1])) + "\n\n")
    assert [r["question_id"] for r in read_records(tmp_path)] == ["q"]
