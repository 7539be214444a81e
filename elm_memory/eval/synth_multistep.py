r"""``synth-multistep``: a seeded generator of harder arithmetic word problems (a second toy stream).

``synth-arith`` (``synth.py``) is easy for the packaged 0.5B model: it is right on about half at 384
tokens, and its vote adds only about 5 points, so a memory that learns what the vote knows has
little to recover. This stream keeps what makes ``synth-arith`` a stream (recurring families of one
problem structure each, interleaved) and makes each problem harder in the ways word problems are
hard: four to six operations, a rounding-up step or a percentage, and one number that the question
does not need (a distractor sentence). It is still templated English with whole-number answers.

Built exactly like ``synth-arith``, with :func:`elm_memory.eval.synth.generate_stream`: a balanced
seeded schedule of families, each problem drawn from its own ``random.Random(f"synth-multistep:{seed}:{i}")``.
The named dataset (``--dataset synth-multistep``) is the vendored ``data/synth_multistep.jsonl``,
``generate(N_PROBLEMS, GENERATOR_SEED)`` written by ``python -m elm_memory.eval.synth_multistep`` and pinned
in ``data/SHA256SUMS``. Ids carry the generator version (``multi1-0042``): bump
:data:`GENERATOR_VERSION` with any change to the output.
"""

from __future__ import annotations

import random
from pathlib import Path

from elm_memory.eval.synth import Family, Params, SynthProblem, generate_stream, generator_cli

GENERATOR_VERSION = "1"
N_PROBLEMS = 1200
GENERATOR_SEED = 2026
ID_PREFIX = f"multi{GENERATOR_VERSION}"

# ---- vocabulary (no digits: every number in a question is one of the problem's numbers) ---------------

_NAMES = ["Ana", "Bruno", "Carla", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kofi", "Lucia", "Mateo"]
_PAIRS = [("apples", "melons"), ("notebooks", "pens"), ("candles", "soaps"), ("plates", "bowls"), ("socks", "hats")]
_VEHICLES = ["van", "truck", "minibus", "car"]
_CROPS = [("tomato", "tomatoes"), ("pepper", "peppers"), ("bean", "beans"), ("strawberry", "strawberries")]
_BAKED = ["cookies", "cupcakes", "brownies", "scones"]
_GOODS = [("toys", "cartons"), ("lamps", "crates"), ("jars", "boxes"), ("chairs", "pallets")]
_LIQUIDS = ["water", "rainwater", "oil"]


def _names(rng: random.Random, n: int) -> list[str]:
    return rng.sample(_NAMES, n)


# ---- samplers: each returns the template's fields, chosen so the answer is a non-negative whole number --


def _market(rng: random.Random) -> Params:
    while True:
        n1, p1, n2, p2 = rng.randint(2, 6), rng.randint(2, 9), rng.randint(2, 8), rng.randint(3, 15)
        d = rng.choice([10, 20, 25, 50])
        if n2 * p2 * d % 100 == 0:
            spent = n1 * p1 + n2 * p2 * (100 - d) // 100
            m = next(b for b in (50, 100, 200) if b > spent)
            item1, item2 = rng.choice(_PAIRS)
            return {
                "A": _names(rng, 1)[0],
                "m": m,
                "n1": n1,
                "p1": p1,
                "n2": n2,
                "p2": p2,
                "d": d,
                "x": rng.randint(11, 90),
                "item1": item1,
                "item2": item2,
            }


def _fuel(rng: random.Random) -> Params:
    while True:
        v1, t1, v2, t2 = rng.randint(4, 9) * 10, rng.randint(2, 5), rng.randint(3, 8) * 10, rng.randint(1, 4)
        e = rng.choice([5, 10, 20])
        if (v1 * t1 + v2 * t2) % e == 0:
            return {
                "v1": v1,
                "t1": t1,
                "v2": v2,
                "t2": t2,
                "e": e,
                "c": rng.randint(2, 4),
                "x": rng.randint(3, 9),
                "vehicle": rng.choice(_VEHICLES),
            }


def _overtime(rng: random.Random) -> Params:
    while True:
        w, h, extra = rng.randint(6, 20) * 2, rng.choice([30, 35, 40]), rng.randint(2, 9)
        s = rng.randint(4, 12) * 10
        if w * h + 3 * w * extra // 2 > s:
            return {"A": _names(rng, 1)[0], "w": w, "h": h, "T": h + extra, "s": s, "x": rng.randint(2, 9)}


def _harvest(rng: random.Random) -> Params:
    while True:
        r, c, k, y, b = (
            rng.randint(3, 9),
            rng.randint(8, 20),
            rng.choice([4, 5]),
            rng.randint(3, 8),
            rng.choice([6, 10, 12]),
        )
        plants = r * c
        if plants % k == 0 and (plants - plants // k) * y % b == 0:
            one, many = rng.choice(_CROPS)
            return {"r": r, "c": c, "k": k, "y": y, "b": b, "x": rng.randint(2, 6), "one": one, "many": many}


def _trip(rng: random.Random) -> Params:
    while True:
        s, t, cap = rng.randint(40, 120), rng.randint(3, 8), rng.choice([20, 25, 30, 40])
        if (s + t) % cap:  # the last bus is part-full: rounding up matters
            return {
                "s": s,
                "t": t,
                "cap": cap,
                "B": rng.randint(8, 20) * 10,
                "p": rng.randint(3, 12),
                "x": rng.randint(3, 9),
            }


def _bake_sale(rng: random.Random) -> Params:
    while True:
        n, m, c = rng.randint(2, 6), rng.choice([12, 18, 24]), rng.randint(4, 12)
        k, p = rng.randint(5, n * m - 2), rng.randint(2, 5)
        q = rng.randint(1, p - 1)
        if k * p + (n * m - k) * q > n * c:
            return {
                "A": _names(rng, 1)[0],
                "n": n,
                "m": m,
                "c": c,
                "k": k,
                "p": p,
                "q": q,
                "x": rng.randint(2, 5),
                "goods": rng.choice(_BAKED),
            }


def _ages(rng: random.Random) -> Params:
    y, k, d = rng.randint(2, 9), rng.randint(2, 4), rng.randint(1, 5)
    b = rng.randint(d + 2, 14)
    a, b_name, c_name = _names(rng, 3)
    return {"A": a, "B": b_name, "C": c_name, "y": y, "a": k * b + y, "k": k, "d": d, "x": rng.randint(2, 9)}


def _tank(rng: random.Random) -> Params:
    f, g, leak = rng.randint(6, 20), rng.randint(3, 12), rng.randint(2, 5)
    minutes, start = rng.randint(5, 30), rng.randint(2, 9) * 10
    return {
        "V": start + minutes * (f + g - leak),
        "v0": start,
        "f": f,
        "g": g,
        "l": leak,
        "x": rng.randint(2, 6),
        "liquid": rng.choice(_LIQUIDS),
    }


def _reading(rng: random.Random) -> Params:
    while True:
        r, d1, e, r2, days = (
            rng.randint(10, 30),
            rng.randint(3, 7),
            rng.randint(10, 40),
            rng.randint(20, 50),
            rng.randint(2, 6),
        )
        if r2 != r:
            return {
                "A": _names(rng, 1)[0],
                "P": r * d1 + e + r2 * days,
                "r": r,
                "d1": d1,
                "e": e,
                "r2": r2,
                "x": rng.randint(11, 30),
            }


def _warehouse(rng: random.Random) -> Params:
    while True:
        start, b, n, s = rng.randint(20, 90), rng.randint(3, 9), rng.randint(10, 30), rng.randint(5, 20)
        if start + b * n - 4 * s > 0:
            things, boxes = rng.choice(_GOODS)
            return {"S": start, "b": b, "n": n, "s": s, "x": rng.randint(3, 12), "things": things, "boxes": boxes}


def _phone(rng: random.Random) -> Params:
    g = rng.randint(2, 10)
    return {
        "A": _names(rng, 1)[0],
        "base": rng.randint(10, 30),
        "g": g,
        "c": rng.randint(2, 6),
        "u": g + rng.randint(1, 5),
        "fee": rng.randint(2, 8) * 5,
        "mo": rng.randint(3, 12),
        "x": rng.randint(15, 60) * 10,
    }


def _glasses(rng: random.Random) -> Params:
    while True:
        n, p = rng.randint(8, 40) * 10, rng.choice([40, 45, 50, 55, 60])
        q, r = rng.choice([10, 20, 25, 30]), rng.choice([10, 20, 25, 40])
        girls = n * p // 100
        if n * p % 100 == 0 and girls * q % 100 == 0 and (n - girls) * r % 100 == 0:
            return {"n": n, "p": p, "q": q, "r": r, "x": rng.randint(12, 40)}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


FAMILIES: tuple[Family, ...] = (
    Family(
        "market_budget",
        5,
        (
            "{A} goes to the market with ${m}. {A} buys {n1} {item1} at ${p1} each and {n2} {item2} at ${p2} each, "
            "and the {item2} are {d}% off. {A}'s brother spent ${x} at the same market. How many dollars does {A} "
            "have left?",
            "Today the {item2} at the market are {d}% off. {A} has ${m} and buys {n1} {item1} for ${p1} each and "
            "{n2} {item2} that cost ${p2} each before the discount. The market has {x} stalls. How much money, in "
            "dollars, does {A} have left?",
        ),
        _market,
        lambda q: q["m"] - q["n1"] * q["p1"] - q["n2"] * q["p2"] * (100 - q["d"]) // 100,
    ),
    Family(
        "fuel_cost",
        5,
        (
            "A {vehicle} drives for {t1} hours at {v1} km/h and then for {t2} hours at {v2} km/h. It uses one "
            "litre of fuel every {e} km, and fuel costs ${c} per litre. The {vehicle} carries {x} passengers. "
            "How many dollars does the fuel for the whole trip cost?",
            "Fuel costs ${c} per litre, and a {vehicle} goes {e} km on one litre. With {x} passengers on board, the "
            "{vehicle} travels at {v1} km/h for {t1} hours, then at {v2} km/h for {t2} hours. What is the cost of "
            "the fuel for the trip, in dollars?",
        ),
        _fuel,
        lambda q: (q["v1"] * q["t1"] + q["v2"] * q["t2"]) // q["e"] * q["c"],
    ),
    Family(
        "overtime_pay",
        6,
        (
            "{A} earns ${w} an hour for the first {h} hours of each week and one and a half times that rate for "
            "every hour after that. Last week {A} worked {T} hours and then spent ${s} of the pay on groceries. "
            "{A} has worked at the same place for {x} years. How many dollars of that week's pay are left?",
            "{A} has had the same job for {x} years. The pay is ${w} per hour up to {h} hours a week, and every "
            "hour beyond {h} is paid at one and a half times the normal rate. {A} worked {T} hours this week and "
            "spent ${s} of the week's pay on groceries. How many dollars of the pay does {A} have left?",
        ),
        _overtime,
        lambda q: q["w"] * q["h"] + 3 * q["w"] * (q["T"] - q["h"]) // 2 - q["s"],
    ),
    Family(
        "harvest_boxes",
        5,
        (
            "A farm has {r} rows of {one} plants with {c} plants in each row. Pests destroy one out of every {k} "
            "plants. Each plant that is left gives {y} {many}, and the {many} are packed in boxes of {b}. The "
            "farmer has {x} helpers. How many boxes are filled?",
            "The farmer has {x} helpers and {r} rows of {one} plants, {c} plants to a row. One in every {k} plants "
            "is lost to pests, and each remaining plant yields {y} {many}. If the {many} go into boxes that hold "
            "{b} each, how many boxes are filled?",
        ),
        _harvest,
        lambda q: (q["r"] * q["c"] - q["r"] * q["c"] // q["k"]) * q["y"] // q["b"],
    ),
    Family(
        "school_trip",
        5,
        (
            "{s} students and {t} teachers go on a school trip. Each bus holds {cap} people and costs ${B} to rent. "
            "Every student pays ${p} for a museum ticket, and teachers get in free. The trip lasts {x} hours. What "
            "is the total cost of the buses and the tickets, in dollars?",
            "A museum ticket costs ${p} for a student and nothing for a teacher. A school sends {s} students and "
            "{t} teachers for a {x}-hour visit, in buses that seat {cap} people each and cost ${B} each to rent. "
            "How many dollars do the buses and tickets cost altogether?",
        ),
        _trip,
        lambda q: _ceil_div(q["s"] + q["t"], q["cap"]) * q["B"] + q["s"] * q["p"],
    ),
    Family(
        "bake_sale_profit",
        6,
        (
            "{A} bakes {n} batches of {m} {goods} for a bake sale. The ingredients cost ${c} per batch. {A} sells "
            "{k} of the {goods} for ${p} each and the rest for ${q} each. The sale runs for {x} hours. How many "
            "dollars of profit does {A} make?",
            "For a bake sale that runs {x} hours, {A} makes {n} batches of {goods} with {m} in each batch, and each "
            "batch costs ${c} in ingredients. {A} sells {k} of them at ${p} each and every other one at ${q}. What "
            "is {A}'s profit in dollars?",
        ),
        _bake_sale,
        lambda q: q["k"] * q["p"] + (q["n"] * q["m"] - q["k"]) * q["q"] - q["n"] * q["c"],
    ),
    Family(
        "ages_sum",
        5,
        (
            "In {y} years, {A} will be {a} years old. {A} is now {k} times as old as {B}, and {C} is {d} years "
            "younger than {B}. {B} has {x} cousins. What is the sum of the three ages now?",
            "{B} has {x} cousins. {A} will be {a} in {y} years, and today {A}'s age is {k} times {B}'s. {C} is {d} "
            "years younger than {B}. How old are {A}, {B} and {C} together now?",
        ),
        _ages,
        lambda q: (q["a"] - q["y"]) + 2 * (q["a"] - q["y"]) // q["k"] - q["d"],
    ),
    Family(
        "tank_fill",
        5,
        (
            "A tank holds {V} litres and already has {v0} litres of {liquid} in it. One pipe adds {f} litres per "
            "minute and a second pipe adds {g} litres per minute, but a leak loses {l} litres per minute. The tank "
            "is {x} metres tall. How many minutes does it take to fill the tank?",
            "A {x}-metre-tall tank with room for {V} litres holds {v0} litres of {liquid}. Two pipes pour in {f} "
            "and {g} litres per minute while a leak drains {l} litres per minute. After how many minutes is the "
            "tank full?",
        ),
        _tank,
        lambda q: (q["V"] - q["v0"]) // (q["f"] + q["g"] - q["l"]),
    ),
    Family(
        "reading_plan",
        4,
        (
            "A book has {P} pages. {A} reads {r} pages a day for {d1} days and then reads {e} pages on one long "
            "evening. The book cost ${x}. If {A} then reads {r2} pages a day, how many more days does {A} need to "
            "finish the book?",
            "{A} bought a {P}-page book for ${x}. {A} read {r} pages a day for {d1} days, then {e} pages in one "
            "evening. Reading {r2} pages a day from now on, in how many more days will {A} finish it?",
        ),
        _reading,
        lambda q: (q["P"] - q["r"] * q["d1"] - q["e"]) // q["r2"],
    ),
    Family(
        "warehouse_week",
        6,
        (
            "A shop starts the week with {S} {things}. On Monday it receives {b} {boxes} of {n} {things} each. It "
            "sells {s} {things} on Tuesday, twice as many on Wednesday, and half as many as on Wednesday on "
            "Thursday. The shop has {x} employees. How many {things} are left after Thursday?",
            "The shop has {x} employees and {S} {things} in stock on Monday morning, when {b} {boxes} with {n} "
            "{things} in each arrive. It sells {s} {things} on Tuesday, double that on Wednesday, and on Thursday "
            "half of Wednesday's sales. How many {things} does it have after Thursday?",
        ),
        _warehouse,
        lambda q: q["S"] + q["b"] * q["n"] - 4 * q["s"],
    ),
    Family(
        "phone_plan",
        6,
        (
            "A phone plan costs ${base} a month and includes {g} GB of data; every extra GB costs ${c}. {A} uses "
            "{u} GB every month and paid a one-time ${fee} sign-up fee. {A}'s phone cost ${x}. How many dollars "
            "does {A} pay for the plan over {mo} months, fee included?",
            "{A} paid ${x} for a phone and signs up for a plan with a ${fee} one-time fee. The plan costs ${base} "
            "a month for {g} GB, plus ${c} for each GB over that. {A} uses {u} GB a month. What does the plan "
            "cost {A} in total for {mo} months, fee included, in dollars?",
        ),
        _phone,
        lambda q: q["fee"] + q["mo"] * (q["base"] + (q["u"] - q["g"]) * q["c"]),
    ),
    Family(
        "glasses_percent",
        5,
        (
            "A school has {n} students, and {p}% of them are girls. {q}% of the girls and {r}% of the boys wear "
            "glasses. The school has {x} classrooms. How many students wear glasses?",
            "Of the {n} students at a school with {x} classrooms, {p}% are girls. Glasses are worn by {q}% of the "
            "girls and by {r}% of the boys. How many students in all wear glasses?",
        ),
        _glasses,
        lambda q: q["n"] * q["p"] // 100 * q["q"] // 100 + (q["n"] - q["n"] * q["p"] // 100) * q["r"] // 100,
    ),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def generate(n: int, seed: int = GENERATOR_SEED) -> list[SynthProblem]:
    """``n`` problems, the same for the same ``(n, seed)``; no question twice (as ``synth.generate``)."""
    return generate_stream(FAMILIES, n, seed, name="synth-multistep", id_prefix=ID_PREFIX)


def vendored_path() -> Path:
    return Path(__file__).with_name("data") / "synth_multistep.jsonl"


def main(argv: list[str] | None = None) -> None:
    prog = "python -m elm_memory.eval.synth_multistep"
    generator_cli(prog, generate, N_PROBLEMS, GENERATOR_SEED, vendored_path(), argv)


if __name__ == "__main__":
    main()
