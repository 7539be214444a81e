"""The toy ``synth-arith`` stream (elm_memory/eval/synth.py) and the checks on stream files.

The gold answers are checked by a second solver written here, separately from the generator:
it reads the numbers off the rendered question text (in the order each phrasing shows them)
and applies its own formula, in exact fractions, so a template whose text and formula disagree,
or a sampler that lets a non-integer answer through, fails.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from fractions import Fraction as F
from importlib import resources
from pathlib import Path

import pytest

from elm_memory.data.datasets import load_problems
from elm_memory.errors import ConfigError, DatasetError
from elm_memory.eval import datasets
from elm_memory.eval.synth import FAMILIES, GENERATOR_SEED, GENERATOR_VERSION, N_PROBLEMS, generate, to_jsonl

# ---- the independent solver ----------------------------------------------------------------------
# structure -> (a phrase that must be in the text, the order in which the text shows the numbers, formula)


def _discount(n, p, d):
    return F(n * p) * (1 - F(d, 100))


SOLVERS = {
    "discount.0": ("% off", "n p d", _discount),
    "discount.1": ("% off", "d n p", lambda d, n, p: _discount(n, p, d)),
    "travel.0": ("km/h", "v t1 w t2", lambda v, t1, w, t2: v * t1 + w * t2),
    "travel.1": ("km/h", "t1 v t2 w", lambda t1, v, t2, w: v * t1 + w * t2),
    "share_remainder.0": ("left over", "a b c k", lambda a, b, c, k: (a + b * c) % k),
    "share_remainder.1": ("left over", "b c a k", lambda b, c, a, k: (a + b * c) % k),
    "ages.0": ("times as old", "c d k y", lambda c, d, k, y: k * (c + d) + y),
    "ages.1": ("times", "d c k y", lambda d, c, k, y: k * (c + d) + y),
    "time_units.0": ("minutes", "h m days", lambda h, m, days: (h * 60 + m) * days),
    "time_units.1": ("minutes", "h m days", lambda h, m, days: (h * 60 + m) * days),
    "percent_growth.0": ("% more", "x p", lambda x, p: x + x * F(100 + p, 100)),
    "percent_growth.1": ("% more", "x p", lambda x, p: x + x * F(100 + p, 100)),
    "work_together.0": ("together", "a b total", lambda a, b, total: F(total, a + b)),
    "work_together.1": ("together", "a b total", lambda a, b, total: F(total, a + b)),
    "average_needed.0": ("average", "s1 s2 s3 avg", lambda s1, s2, s3, avg: avg * 4 - (s1 + s2 + s3)),
    "average_needed.1": ("average", "s1 s2 s3 avg", lambda s1, s2, s3, avg: avg * 4 - (s1 + s2 + s3)),
    "change.0": ("change", "n1 p1 n2 p2 paid", lambda n1, p1, n2, p2, paid: paid - (n1 * p1 + n2 * p2)),
    "change.1": ("change", "n1 p1 n2 p2 paid", lambda n1, p1, n2, p2, paid: paid - (n1 * p1 + n2 * p2)),
    "recipe_scaling.0": ("more", "s f t have", lambda s, f, t, have: F(t, s) * f - have),
    "recipe_scaling.1": ("more", "s f t have", lambda s, f, t, have: F(t, s) * f - have),
    "savings.0": ("every week", "s w c", lambda s, w, c: F(c - s, w)),
    "savings.1": ("every week", "c s w", lambda c, s, w: F(c - s, w)),
    "stock.0": ("twice as many", "a n s", lambda a, n, s: a * n - s - 2 * s),
    "stock.1": ("twice as many", "a n s", lambda a, n, s: a * n - s - 2 * s),
}


def solve(question: str, structure: str, solvers: dict = SOLVERS) -> F:
    """``solvers[structure]``'s formula on the numbers the question shows, in order (test_synth_multistep's too)."""
    phrase, roles, formula = solvers[structure]
    numbers = [int(x) for x in re.findall(r"\d+", question)]
    assert phrase in question, (structure, question)
    assert len(numbers) == len(roles.split()), (structure, question)
    return F(formula(*numbers))


def check_gold(question: str, structure: str, answer: str, solvers: dict = SOLVERS) -> None:
    value = solve(question, structure, solvers)
    assert value.denominator == 1 and value >= 0, (question, value)
    assert answer == str(value.numerator), (question, answer, value)


# ---- the generator ---------------------------------------------------------------------------------


def test_gold_answers_agree_with_an_independent_solution_over_many_seeds():
    checked = set()
    for seed in range(60):
        for p in generate(120, seed):
            check_gold(p.question, p.structure, str(p.answer))
            checked.add(p.structure)
    assert checked == set(SOLVERS)  # every phrasing of every family was exercised


def test_the_independent_check_can_fail():
    p = generate(1, 5)[0]
    with pytest.raises(AssertionError):
        check_gold(p.question, p.structure, str(p.answer + 1))
    digits = re.findall(r"\d+", p.question)
    changed = p.question.replace(digits[0], str(int(digits[0]) + 7), 1)  # a text/formula mismatch
    with pytest.raises(AssertionError):
        check_gold(changed, p.structure, str(p.answer))


def test_generator_is_seeded_and_stable_in_n():
    a = generate(60, 3)
    assert a == generate(60, 3)
    assert [p.question for p in a] != [p.question for p in generate(60, 4)]
    assert generate(25, 3) == a[:25]
    assert len({p.question for p in a}) == len(a) and len({p.id for p in a}) == len(a)


def test_at_least_eight_families_of_two_to_four_steps():
    assert len(FAMILIES) >= 8 and len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert all(2 <= f.steps <= 4 and len(f.templates) >= 2 for f in FAMILIES)


#: The vendored file's sha256 for each generator version: output that changes without a new version fails here.
PINNED = {"1": "f96d59af82b8839e9cf0202e1eb979d6c190653c0f95538a630484d060f772d3"}


def test_vendored_file_is_exactly_what_the_generator_makes():
    data = resources.files("elm_memory.eval").joinpath("data")
    raw = data.joinpath("synth_arith.jsonl").read_bytes()
    assert raw.decode("utf-8") == to_jsonl(generate(N_PROBLEMS, GENERATOR_SEED))
    sums = dict(reversed(line.split("  ")) for line in data.joinpath("SHA256SUMS").read_text().splitlines())
    assert sums["synth_arith.jsonl"] == hashlib.sha256(raw).hexdigest()
    assert PINNED.get(GENERATOR_VERSION) == hashlib.sha256(raw).hexdigest(), "new output needs a new GENERATOR_VERSION"
    assert all(p.id.startswith(f"synth{GENERATOR_VERSION}-") for p in generate(3, 1))  # new version, new ids


def test_named_dataset_is_a_seeded_stream_with_recurring_interleaved_families():
    whole = load_problems("synth-arith")
    assert len(whole) == N_PROBLEMS and len({p.question for p in whole}) == N_PROBLEMS
    for p in whole:
        check_gold(p.question, p.structure, p.answer)
        assert p.family == p.structure.split(".")[0]
    k = len(FAMILIES)  # file order: every block of k questions holds every family once
    assert all(len({p.family for p in whole[i : i + k]}) == k for i in range(0, N_PROBLEMS - k + 1, k))

    stream = load_problems("synth-arith", limit=200, seed=17)
    assert [p.id for p in stream] == [p.id for p in load_problems("synth-arith", limit=200, seed=17)]
    assert [p.id for p in stream] != [p.id for p in load_problems("synth-arith", limit=200, seed=42)]
    assert [p.id for p in load_problems("synth-arith", limit=48, seed=17)] == [p.id for p in stream[:48]]
    first = stream[:48]
    assert len({p.family for p in first}) >= 8
    # families recur along the stream: each one seen early comes back later, and none comes in a long run
    assert {p.family for p in first} <= {p.family for p in stream[48:]}
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(p.family for p in stream)]
    assert max(runs) <= 4


# ---- stream files: refused before anything runs, naming the line -------------------------------------

GOOD = '{"id": "q1", "question": "What is 2+3?", "answer": 5}'


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "q2", "question": "What is 1+1?"}', "no gold 'answer'"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": null}', "no gold 'answer'"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": [2]}', "must be a number or a string, not list"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": true}', "must be a number or a string, not bool"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": {"v": 2}}', "must be a number or a string, not dict"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": NaN}', "not a finite number"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": ""}', "is empty"),
        ('{"id": "q2", "question": "What is 1+1?", "answer": " $ "}', "is empty"),
        ('{"id": "q2", "question": "", "answer": 2}', "empty question"),
        ('{"id": "q2", "question": "  \\n ", "answer": 2}', "empty question"),
        ('{"id": "q2", "question": 12, "answer": 2}', "'question' is a int"),
        ('{"id": "q2", "answer": 2}', "no 'question'"),
        ('{"id": "q1", "question": "What is 1+1?", "answer": 2}', "duplicate id 'q1' (first on line 1)"),
        ('{"id": null, "question": "What is 1+1?", "answer": 2}', "'id' must be"),
        ('["What is 1+1?", 2]', "needs a JSON object"),
        ('{"question": "What is 1+1?", "answer": 2', "not valid JSON"),
    ],
)
def test_bad_stream_file_is_refused_naming_the_line(tmp_path, line, message):
    path = tmp_path / "stream.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD.replace('q1', 'q4')}\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_problems(str(path))
    text = str(info.value)
    assert "stream.jsonl:3: " in text and message in text and "\n" not in text, text
    assert isinstance(info.value, ConfigError)  # callers catching ConfigError keep working


def test_stream_file_edge_cases_that_are_fine(tmp_path):
    path = tmp_path / "ok.jsonl"
    rows = [
        {"question": "Half of 5?", "answer": 2.5, "family": "halves"},
        {"id": 7, "question": "x?", "answer": "\\frac{1}{2}"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    problems = load_problems(str(path))
    assert [(p.id, p.answer, p.family) for p in problems] == [("ok-1", "2.5", "halves"), ("7", "\\frac{1}{2}", None)]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9?", "answer": 1}\n')
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_problems(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n \n")
    with pytest.raises(DatasetError, match="no questions"):
        load_problems(str(tmp_path / "blank.jsonl"))


def test_every_vendored_set_passes_the_checks():
    assert {"gsm8k", "math500", "amc23", "aime24", "synth-arith"} <= set(datasets.DATASETS)
    for name in datasets.DATASETS:
        assert load_problems(name)


def test_math500_easy_keeps_levels_one_to_three_of_math500_in_file_order():
    easy = load_problems("math500-easy")
    text = resources.files("elm_memory.eval").joinpath("data", "math500.jsonl").read_text(encoding="utf-8")
    levels = {row["id"]: row["level"] for row in map(json.loads, text.splitlines())}
    assert len(easy) == 238
    assert {levels[p.id] for p in easy} == {1, 2, 3}
    assert [p.id for p in easy] == [pid for pid in levels if levels[pid] <= 3]
    assert [p.id for p in load_problems("math500-easy", limit=5, seed=3)] != [p.id for p in easy[:5]]


def test_a_vendored_file_that_differs_from_its_checksum_is_refused(tmp_path, monkeypatch):
    data = tmp_path / "eval" / "data"  # the files stay in elm_memory/eval/data; data.datasets reads them there
    data.mkdir(parents=True)
    real = resources.files("elm_memory.eval").joinpath("data")
    (data / "SHA256SUMS").write_bytes(real.joinpath("SHA256SUMS").read_bytes())
    (data / "synth_arith.jsonl").write_bytes(real.joinpath("synth_arith.jsonl").read_bytes().replace(b'"5"', b'"6"', 1))
    monkeypatch.setattr(datasets.resources, "files", lambda _pkg: tmp_path)
    with pytest.raises(DatasetError, match="does not match data/SHA256SUMS"):
        load_problems("synth-arith")


def test_cli_refuses_a_bad_stream_before_loading_any_model(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f'{GOOD}\n{{"id": "q2", "question": "Sum?", "answer": "  "}}\n', encoding="utf-8")
    out = tmp_path / "run"
    # a model that does not exist: had it been loaded first, the error would be about the model
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elm_memory.cli",
            "stream",
            "--dataset",
            str(bad),
            "--out",
            str(out),
            "-m",
            "zero_shot",
            "--set",
            "model.name_or_path=/tmp/definitely-missing.gguf",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("error: ") and "bad.jsonl:2: gold answer" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not Path(out).exists()  # nothing was started
