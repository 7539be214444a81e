"""The harder toy stream ``synth-multistep`` (elm_memory/eval/synth_multistep.py).

As for ``synth-arith``, the gold answers are checked by a second solver written here: it reads the
numbers off the question text in the order each phrasing shows them (the distractor ``x`` included,
and ignored) and applies its own formula in exact fractions.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from fractions import Fraction as F
from importlib import resources

import pytest
import test_synth as synth_checks

from elm_memory.data.datasets import load_problems
from elm_memory.eval.synth import to_jsonl
from elm_memory.eval.synth_multistep import (
    FAMILIES,
    GENERATOR_SEED,
    GENERATOR_VERSION,
    N_PROBLEMS,
    generate,
)


def _market(m, n1, p1, n2, p2, d):
    return m - n1 * p1 - n2 * p2 * (1 - F(d, 100))


def _fuel(t1, v1, t2, v2, e, c):
    return F(v1 * t1 + v2 * t2, e) * c


def _overtime(w, h, hours, spent):
    return w * h + F(3, 2) * w * (hours - h) - spent


def _harvest(r, c, k, y, b):
    return r * c * (1 - F(1, k)) * y / b


def _trip(s, t, cap, bus, p):
    return math.ceil(F(s + t, cap)) * bus + s * p


def _profit(n, m, c, k, p, q):
    return k * p + (n * m - k) * q - n * c


def _ages(y, a, k, d):
    now = a - y
    return now + F(now, k) + (F(now, k) - d)


def _glasses(n, p, q, r):
    girls = n * F(p, 100)
    return girls * F(q, 100) + (n - girls) * F(r, 100)


# structure -> (a phrase that must be in the text, the order of the text's numbers, formula without x)
SOLVERS = {
    "market_budget.0": ("% off", "m n1 p1 n2 p2 d x", lambda m, n1, p1, n2, p2, d, x: _market(m, n1, p1, n2, p2, d)),
    "market_budget.1": ("% off", "d m n1 p1 n2 p2 x", lambda d, m, n1, p1, n2, p2, x: _market(m, n1, p1, n2, p2, d)),
    "fuel_cost.0": ("litre", "t1 v1 t2 v2 e c x", lambda t1, v1, t2, v2, e, c, x: _fuel(t1, v1, t2, v2, e, c)),
    "fuel_cost.1": ("litre", "c e x v1 t1 v2 t2", lambda c, e, x, v1, t1, v2, t2: _fuel(t1, v1, t2, v2, e, c)),
    "overtime_pay.0": ("one and a half", "w h hours s x", lambda w, h, hours, s, x: _overtime(w, h, hours, s)),
    "overtime_pay.1": ("one and a half", "x w h h2 hours s", lambda x, w, h, h2, hours, s: _overtime(w, h2, hours, s)),
    "harvest_boxes.0": ("Pests", "r c k y b x", lambda r, c, k, y, b, x: _harvest(r, c, k, y, b)),
    "harvest_boxes.1": ("pests", "x r c k y b", lambda x, r, c, k, y, b: _harvest(r, c, k, y, b)),
    "school_trip.0": ("bus", "s t cap bus p x", lambda s, t, cap, bus, p, x: _trip(s, t, cap, bus, p)),
    "school_trip.1": ("buses", "p s t x cap bus", lambda p, s, t, x, cap, bus: _trip(s, t, cap, bus, p)),
    "bake_sale_profit.0": ("profit", "n m c k p q x", lambda n, m, c, k, p, q, x: _profit(n, m, c, k, p, q)),
    "bake_sale_profit.1": ("profit", "x n m c k p q", lambda x, n, m, c, k, p, q: _profit(n, m, c, k, p, q)),
    "ages_sum.0": ("younger", "y a k d x", lambda y, a, k, d, x: _ages(y, a, k, d)),
    "ages_sum.1": ("younger", "x a y k d", lambda x, a, y, k, d: _ages(y, a, k, d)),
    "tank_fill.0": ("leak", "V v0 f g leak x", lambda V, v0, f, g, leak, x: F(V - v0, f + g - leak)),
    "tank_fill.1": ("leak", "x V v0 f g leak", lambda x, V, v0, f, g, leak: F(V - v0, f + g - leak)),
    "reading_plan.0": ("pages", "P r d1 e x r2", lambda P, r, d1, e, x, r2: F(P - r * d1 - e, r2)),
    "reading_plan.1": ("pages", "P x r d1 e r2", lambda P, x, r, d1, e, r2: F(P - r * d1 - e, r2)),
    "warehouse_week.0": ("twice as many", "S b n s x", lambda S, b, n, s, x: S + b * n - s - 2 * s - F(2 * s, 2)),
    "warehouse_week.1": ("double", "x S b n s", lambda x, S, b, n, s: S + b * n - s - 2 * s - F(2 * s, 2)),
    "phone_plan.0": ("GB", "base g c u fee x mo", lambda base, g, c, u, fee, x, mo: fee + mo * (base + (u - g) * c)),
    "phone_plan.1": ("GB", "x fee base g c u mo", lambda x, fee, base, g, c, u, mo: fee + mo * (base + (u - g) * c)),
    "glasses_percent.0": ("glasses", "n p q r x", lambda n, p, q, r, x: _glasses(n, p, q, r)),
    "glasses_percent.1": ("glasses", "n x p q r", lambda n, x, p, q, r: _glasses(n, p, q, r)),
}


def solve(question: str, structure: str) -> F:
    return synth_checks.solve(question, structure, SOLVERS)


def check_gold(question: str, structure: str, answer: str) -> None:
    synth_checks.check_gold(question, structure, answer, SOLVERS)


def test_gold_answers_agree_with_an_independent_solution_over_many_seeds():
    checked = set()
    for seed in range(40):
        for p in generate(96, seed):
            check_gold(p.question, p.structure, str(p.answer))
            checked.add(p.structure)
    assert checked == set(SOLVERS)  # every phrasing of every family was exercised


def test_the_distractor_is_not_needed_and_the_check_can_fail():
    for p in generate(24, 5):
        roles = SOLVERS[p.structure][1].split()
        spans = list(re.finditer(r"\d+", p.question))
        x = spans[roles.index("x")]
        other = p.question[: x.start()] + str(int(x.group()) + 3) + p.question[x.end() :]
        assert solve(other, p.structure) == p.answer  # the distractor changes nothing
        used = spans[0 if roles[0] != "x" else 1]
        changed = p.question[: used.start()] + str(int(used.group()) + 7) + p.question[used.end() :]
        with pytest.raises(AssertionError):
            check_gold(changed, p.structure, str(p.answer))


def test_twelve_families_of_four_to_six_steps_each_with_two_phrasings():
    assert len(FAMILIES) == 12 and len({f.name for f in FAMILIES}) == 12
    assert all(4 <= f.steps <= 6 and len(f.templates) == 2 for f in FAMILIES)


def test_generator_is_seeded_stable_in_n_and_never_repeats_a_question():
    a = generate(48, 3)
    assert a == generate(48, 3) and generate(20, 3) == a[:20]
    assert [p.question for p in a] != [p.question for p in generate(48, 4)]
    whole = generate(N_PROBLEMS, GENERATOR_SEED)
    assert len({p.question for p in whole}) == N_PROBLEMS


#: The vendored file's sha256 for each generator version: output that changes without a new version fails here.
PINNED = {"1": "57aad0a688f6f8a149400cb7653e268416035df3a1ca09da3e88214c5ecb8441"}


def test_vendored_file_is_exactly_what_the_generator_makes():
    data = resources.files("elm_memory.eval").joinpath("data")
    raw = data.joinpath("synth_multistep.jsonl").read_bytes()
    assert raw.decode("utf-8") == to_jsonl(generate(N_PROBLEMS, GENERATOR_SEED))
    sums = dict(reversed(line.split("  ")) for line in data.joinpath("SHA256SUMS").read_text().splitlines())
    assert sums["synth_multistep.jsonl"] == hashlib.sha256(raw).hexdigest()
    assert PINNED.get(GENERATOR_VERSION) == hashlib.sha256(raw).hexdigest(), "new output needs a new GENERATOR_VERSION"
    assert all(p.id.startswith(f"multi{GENERATOR_VERSION}-") for p in generate(3, 1))


def test_named_dataset_is_a_seeded_stream_of_recurring_interleaved_families():
    whole = load_problems("synth-multistep")
    assert len(whole) == N_PROBLEMS
    for p in whole:
        check_gold(p.question, p.structure, p.answer)
    stream = load_problems("synth-multistep", limit=200, seed=89)
    assert [p.id for p in stream] != [p.id for p in load_problems("synth-multistep", limit=200, seed=97)]
    assert {p.family for p in stream[:48]} <= {p.family for p in stream[48:]}
    assert max(len(list(g)) for _, g in itertools.groupby(p.family for p in stream)) <= 4
