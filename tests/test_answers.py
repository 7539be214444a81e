r"""Tests for elm_memory.answers: extraction, equivalence, majority vote, TTRL rewards."""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time

import pytest

from elm_memory.answers import (
    Vote,
    equivalent,
    extract_answer,
    is_answer_closed,
    majority_rewards,
    majority_vote,
    symbolic,
)

PATHOLOGICAL = "\\boxed{" + "9" * 5000 + "^" + "9" * 5000 + "}"

# ------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b^{2}}}}", r"\sqrt{\frac{a}{b^{2}}}"),
        (r"\boxed{1} first, then \boxed{2}", "2"),
        (r"\boxed{1}\boxed{2}\boxed{3}", "3"),
        (r"\boxed{3} and finally \boxed{\frac{1", "3"),
        (r"\boxed{4} \boxed{", "4"),
        (r"\fbox{7}", "7"),
        (r"\boxed {8}", "8"),
        ("\\boxed\n{9}", "9"),
        (r"\boxed{\boxed{5}}", "5"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{ $42$ }.", "42"),
        (r"\boxed{12.}", "12"),
        (r"\boxed{5} later \boxed{}", "5"),
        (r"\boxed{-3} } stray brace", "-3"),
    ],
)
def test_extract_boxed(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Therefore, the final answer is $42$.", "42"),
        ("The final answer is: 3/4", "3/4"),
        ("Answer: 17\nsome trailing text", "17"),
        ("answer: 1\nanswer: 2\n", "2"),
        ("blah\n#### 1,000", "1,000"),
        (r"**Final Answer:** $\frac{3}{4}$", r"\frac{3}{4}"),
        (r"The final answer is \(x+1\) since", "x+1"),
    ],
)
def test_extract_patterns_fallback(text: str, expected: str) -> None:
    assert extract_answer(text) == expected
    assert extract_answer(text, fallback="patterns") == expected
    assert extract_answer(text, fallback="none") is None


@pytest.mark.parametrize(
    "text",
    [
        "Let me compute 12 + 13 = 25 and then",  # unfinished rollout: numbers but no answer
        r"so we get \boxed{",
        r"\boxed{}",
        r"\boxed{  $ $ }",
        "The final answer is \\boxed{12",  # a cut-off box after the pattern is no answer
        "",
    ],
)
def test_extract_none_by_default(text: str) -> None:
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Let me compute 12 + 13 = 25 and then", "25"),
        ("the totals are 1,234 and -7.5 so", "-7.5"),
        ("pages 3-4", "4"),
        ("no digits at all", None),
        (r"\boxed{9} though 10 is also possible", "9"),  # a box still wins
        ("answer: 3\nthen 99", "3"),  # patterns come before the last number
    ],
)
def test_extract_last_number_opt_in(text: str, expected: str | None) -> None:
    assert extract_answer(text, fallback="last_number") == expected


@pytest.mark.parametrize("bad", [b"\\boxed{1}", None, 12, ["\\boxed{1}"]])
def test_extract_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        extract_answer(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        is_answer_closed(bad)  # type: ignore[arg-type]


def test_extract_unknown_fallback() -> None:
    with pytest.raises(ValueError):
        extract_answer("x", fallback="first_number")  # type: ignore[arg-type]


JUNK = [
    "}" * 50 + "{" * 50,
    "\\boxed{" * 1000,
    "\\" * 1001,
    "$$$$..$$..",
    "\\boxed{\\}",
    "\\boxed{\\\\}",
    "\x00\x01\ufffd\U0001f600",
    "####",
    "answer:",
    "final answer is",
    "\\fbox",
    "\\boxed \n\t",
]


@pytest.mark.parametrize("text", JUNK)
@pytest.mark.parametrize("fallback", ["none", "patterns", "last_number"])
def test_extract_junk_never_raises(text: str, fallback: str) -> None:
    result = extract_answer(text, fallback=fallback)  # type: ignore[arg-type]
    assert result is None or (isinstance(result, str) and result.strip() != "")
    assert isinstance(is_answer_closed(text), bool)


def test_extract_junk_values() -> None:
    assert extract_answer("\\boxed{\\\\}") == "\\\\"
    assert extract_answer("\\boxed{\\}") is None  # "\}" is escaped: the box never closes
    assert extract_answer("####") is None
    assert extract_answer("answer:") is None


def test_extract_random_junk_never_raises() -> None:
    rng = random.Random(0)
    alphabet = "\\{}$^_ 0123456789abx+-*/()[],.=!#:\nboxedfinalswr"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        for fallback in ("none", "patterns", "last_number"):
            result = extract_answer(text, fallback=fallback)  # type: ignore[arg-type]
            assert result is None or isinstance(result, str)
        assert isinstance(is_answer_closed(text), bool)


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{" * 200_000,
        "{" * 500_000 + "\\boxed{1}",
        "\\boxed{" * 50_000 + "}" * 50_000,
        "\\boxed{" + "$." * 200_000 + "}",
        "answer: " * 100_000,
        "9" * 500_000 + " 1,2,3" * 50_000,
        "\\boxed" + " " * 500_000,
        "\\" * 500_000,
    ],
)
def test_extract_huge_inputs_are_linear(text: str) -> None:
    start = time.perf_counter()
    extract_answer(text, fallback="last_number")
    is_answer_closed(text)
    assert time.perf_counter() - start < 3.0


def test_extract_huge_values() -> None:
    assert extract_answer("{" * 500_000 + "\\boxed{1}") == "1"
    assert extract_answer("x " * 500_000 + "\\boxed{2} " + "y " * 500_000) == "2"


# ------------------------------------------------------------------------ is_answer_closed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no box yet", False),
        (r"\boxed{", False),
        (r"\boxed{\frac{1}{2}", False),
        (r"\boxed{\frac{1}{2}}", True),
        (r"\boxed{}", False),
        (r"put it in \boxed{} ... so \boxed{3", False),
        (r"\fbox{x}", True),
        (r"\boxed{1} and \boxed{", True),
    ],
)
def test_is_answer_closed(text: str, expected: bool) -> None:
    assert is_answer_closed(text) is expected


def test_is_answer_closed_on_growing_text() -> None:
    full = r"We get $x = 2$. So \boxed{\frac{1}{2}} is it."
    closing = full.index("}} is") + 2  # the prefix that first holds the closing brace
    flags = [is_answer_closed(full[:n]) for n in range(len(full) + 1)]
    assert flags.index(True) == closing
    assert all(flags[closing:])


# ------------------------------------------------------------------------- equivalence

EQUIVALENT = [
    ("1/2", r"\frac{1}{2}"),
    (r"\frac{1}{2}", "0.5"),
    ("1/2", "0.5"),
    (r"\dfrac{3}{4}", r"\frac34"),
    (r"\tfrac{3}{4}", "0.75"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"10\%", "10"),  # decision: the percent sign is dropped
    ("10%", "10"),
    ("1,000", "1000"),
    ("1,234,567", "1234567"),
    ("1{,}000", "1000"),
    (r"1\,000", "1000"),
    ("18", "18.0"),
    ("18.50", "18.5"),
    (".5", "0.5"),
    ("x=5", "5"),  # decision: a single-variable assignment equals its value
    ("x = 5", "5"),
    (r"\text{(B)}", "B"),
    (r"\text{(B)}", "(B)"),
    (r"\textbf{(B)}", "B"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"5\text{ cm}", "5"),
    (r"12 \text{ cm}^2", "12"),
    (r"\$1,000", "1000"),
    (r"\{1, 2\}", r"\{2, 1\}"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}"),
    ("-3", "−3"),
    (r"\sqrt2", r"\sqrt{2}"),
    ("2^{2024}", "2^{2024}"),
    ("abc", "abc"),  # identical junk is identical
    (PATHOLOGICAL[7:-1], PATHOLOGICAL[7:-1]),
]

NOT_EQUIVALENT = [
    ("1/2", "2"),
    ("18", "81"),
    (r"10\%", "0.1"),  # consequence of dropping the percent sign
    ("x=5", "y=5"),
    ("1,2", "12"),  # a list, not a thousands separator
    (r"\text{(A)}", "B"),
    (r"\pi", "3.14"),
    ("foo", "bar"),
    ("}{)(", "]["),
    ("\\boxed{", "\\frac{"),
    ("", ""),
    ("  $ $ ", "  "),
    ("9^{9^{9}}", "1"),  # guarded: sympy would hang in big-integer arithmetic
]


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_equivalent_true(a: str, b: str) -> None:
    assert equivalent(a, b) is True
    assert equivalent(b, a) is True


@pytest.mark.parametrize(("a", "b"), NOT_EQUIVALENT)
def test_equivalent_false(a: str, b: str) -> None:
    assert equivalent(a, b) is False
    assert equivalent(b, a) is False


@pytest.mark.parametrize("other", ["1", None, "", "None"])
def test_equivalent_none_is_never_equivalent(other: str | None) -> None:
    assert equivalent(None, other) is False
    assert equivalent(other, None) is False


@pytest.mark.parametrize("bad", [b"1", 1, 1.0, ["1"]])
def test_equivalent_non_str_is_false_not_error(bad: object) -> None:
    assert equivalent(bad, "1") is False  # type: ignore[arg-type]
    assert equivalent("1", bad) is False  # type: ignore[arg-type]


def test_equivalent_random_junk_never_raises() -> None:
    rng = random.Random(1)
    alphabet = "\\{}$^_ 0123456789abx+-*/()[],.=!%"
    for _ in range(40):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        assert isinstance(equivalent(a, b, timeout=0.5), bool)


def test_equivalent_zero_timeout_uses_fast_path_only() -> None:
    assert equivalent(r"\dfrac{3}{4}", r"\frac34", timeout=0) is True
    assert equivalent("1/2", "0.5", timeout=0) is False


def _in_thread(fn, *args):
    """Run fn in a plain threading.Thread; return (result, error, seconds)."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    start = time.perf_counter()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "call did not return"
    return out.get("result"), out.get("error"), time.perf_counter() - start


def test_equivalent_math_verify_works_in_worker_thread() -> None:
    # math-verify's signal.alarm timeout raises outside the main thread; ours must not.
    result, error, _ = _in_thread(lambda: equivalent(r"\frac{6}{8}", "0.750"))
    assert error is None
    assert result is True
    result, error, _ = _in_thread(lambda: equivalent(r"\frac{6}{8}", "0.76"))
    assert error is None
    assert result is False


def test_equivalent_does_not_use_signal_alarm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even in the main thread: math-verify's alarm would replace pytest-timeout's handler.
    alarms: list[object] = []
    monkeypatch.setattr(signal, "alarm", lambda seconds: alarms.append(seconds) or 0)
    before = signal.getsignal(signal.SIGALRM)
    assert equivalent(r"3\sqrt{3}", r"\sqrt{27}") is True
    assert equivalent(r"3\sqrt{3}", r"\sqrt{28}") is False
    assert alarms == []
    assert signal.getsignal(signal.SIGALRM) is before


def _pathological_roundtrip() -> tuple:
    answer = extract_answer(PATHOLOGICAL)
    return (
        answer is not None and len(answer),
        equivalent(answer, "1"),
        equivalent(answer, answer + "0"),
        equivalent("9^{9^{9}}", "10^{10^{10}}"),
        equivalent(r"10^{100}!", "1"),
        majority_vote([answer, "1", answer]).count,
    )


EXPECTED_PATHOLOGICAL = (10001, False, False, False, False, 2)


def test_pathological_input_main_thread() -> None:
    start = time.perf_counter()
    assert _pathological_roundtrip() == EXPECTED_PATHOLOGICAL
    assert time.perf_counter() - start < 5.0


def test_pathological_input_worker_thread() -> None:
    result, error, seconds = _in_thread(_pathological_roundtrip)
    assert error is None
    assert result == EXPECTED_PATHOLOGICAL
    assert seconds < 5.0


def test_equivalent_timeout_counts_as_not_equivalent(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    calls: list[tuple[str, str]] = []

    def slow(a: str, b: str) -> bool:
        calls.append((a, b))
        release.wait(10)  # stands in for a sympy call that takes far too long
        return True

    monkeypatch.setattr(symbolic, "math_verify_equal", slow)
    try:
        start = time.perf_counter()
        assert equivalent("\\frac{11}{13}", "0.846153846", timeout=0.3) is False
        assert time.perf_counter() - start < 2.0
        assert calls == [("0.846153846", "\\frac{11}{13}")]
        # From a worker thread too (here the slow call still holds the math-verify lock).
        result, error, seconds = _in_thread(lambda: equivalent("\\frac{11}{13}", "0.8461", timeout=0.3))
        assert (result, error) == (False, None)
        assert seconds < 2.0
    finally:
        release.set()  # let the abandoned worker finish and release the math-verify lock
    time.sleep(0.05)


# ----------------------------------------------------------------------- majority vote


def test_vote_share_and_frozen() -> None:
    assert Vote("1", 2, 4).share == 0.5
    assert Vote(None, 0, 0).share == 0.0
    assert Vote(None, 0, 3).share == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        Vote("1", 1, 1).count = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        (["1/2", "0.5", "3", None], Vote("1/2", 2, 4)),
        ([r"\frac{1}{2}", "3", "3", "0.5", "1/2"], Vote(r"\frac{1}{2}", 3, 5)),
        (["3", "5", "5", "3"], Vote("3", 2, 4)),  # tie: first appearance wins
        (["7", "2", "2.0", "7.0"], Vote("7", 2, 4)),
        (["4", None, "9"], Vote("4", 1, 3)),
        ([None, "x=5", "5", "y=5"], Vote("x=5", 2, 4)),
        ([None, None], Vote(None, 0, 2)),
        ([], Vote(None, 0, 0)),
        (["1,000", "1000", "1000.0", "100"], Vote("1,000", 3, 4)),
    ],
)
def test_majority_vote(votes: list[str | None], expected: Vote) -> None:
    assert majority_vote(votes) == expected


def test_majority_vote_greedy_uses_first_matching_class() -> None:
    # "x=5" ~ "5" and "y=5" ~ "5", but "x=5" is not ~ "y=5": equivalence is not
    # transitive, so the classes depend on order. Each answer joins the FIRST class whose
    # representative is equivalent.
    assert majority_vote(["5", "x=5", "y=5"]) == Vote("5", 3, 3)
    assert majority_vote(["x=5", "y=5", "5"]) == Vote("x=5", 2, 3)
    assert majority_rewards(["x=5", "y=5", "5"]) == [1.0, 0.0, 1.0]


COMPLETIONS = [
    r"We simplify the ratio and get \boxed{\frac{1}{2}}.",
    r"Converting to a decimal, $x = 0.5$, so the answer is \boxed{0.5}",
    r"Hmm, I think it is \boxed{3}.",
    r"Let me keep going: the answer is \boxed{",  # cut off mid-answer
    "Putting it together, the final answer is 1/2.",
    "I computed 1 + 1 = 2 and then ran out of tokens",
]


def test_majority_rewards_on_completions() -> None:
    extracted = [extract_answer(c) for c in COMPLETIONS]
    assert extracted == [r"\frac{1}{2}", "0.5", "3", None, "1/2", None]
    vote = majority_vote(extracted)
    assert vote == Vote(r"\frac{1}{2}", 3, 6)
    assert vote.share == 0.5
    expected = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert majority_rewards(extracted) == expected
    assert majority_rewards(extracted, vote) == expected


def test_majority_rewards_with_given_vote_and_no_answers() -> None:
    assert majority_rewards(["3", "3.0", "4", None], Vote("4", 1, 4)) == [0.0, 0.0, 1.0, 0.0]
    assert majority_rewards([None, None]) == [0.0, 0.0]
    assert majority_rewards([]) == []


def test_majority_rewards_last_number_opt_in_changes_rewards() -> None:
    # With the default fallback the unfinished rollout gets no answer (and no reward);
    # with last_number it would vote "2" and be rewarded for a cut-off rollout.
    unfinished = ["I computed 1 + 1 = 2 and then", "so far 2", r"\boxed{3}"]
    default = [extract_answer(c) for c in unfinished]
    assert majority_vote(default) == Vote("3", 1, 3)
    opt_in = [extract_answer(c, fallback="last_number") for c in unfinished]
    assert majority_vote(opt_in) == Vote("2", 2, 3)
    assert majority_rewards(opt_in) == [1.0, 1.0, 0.0]
