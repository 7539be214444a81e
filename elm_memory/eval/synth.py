r"""``synth-arith``: a seeded generator of multi-step arithmetic word problems (a toy stream).

The real benchmarks are too hard for the packaged 0.5B model to show anything (about a quarter
of GSM8K), so a memory has little to work with. This stream is easy enough that the default
model is right more often than not, and made of a few recurring *families*: each family is one
problem structure (the same chain of 2-4 operations) with fresh names, objects and numbers, so a
memory learned on one question meets questions of the same shape later in the stream.

It is a toy: templated English, small integers, no distractors. It shows whether a method can
use experience on a stream where the model has signal; it says nothing about real benchmarks.

How it is built
    * A :class:`Family` is declarative: a few phrasings (``templates``, ``str.format`` text),
      a ``sample`` function that draws the numbers (chosen so every answer is a whole number),
      and a ``solve`` function that computes the gold answer from those numbers.
    * Problem ``i`` of ``generate(n, seed)`` takes its family from a balanced schedule (each
      block of ``len(FAMILIES)`` problems holds every family once, in a seeded random order, so
      families recur all along the stream, interleaved, never in runs), and draws everything
      else from its own ``random.Random(f"synth-arith:{seed}:{i}")``. Changing one family
      changes only that family's problems.
    * Each problem records its ``family`` and ``structure`` (``family.phrasing``).

The named dataset (``--dataset synth-arith``) is a vendored file, ``data/synth_arith.jsonl``:
``generate(N_PROBLEMS, GENERATOR_SEED)`` written once by ``python -m elm_memory.eval.synth``,
pinned in ``data/SHA256SUMS`` and loaded, shuffled by ``--seed`` and cut to ``--limit``, like the
real benchmarks. Ids carry the generator version (``synth1-0042``), and a run directory's identity
is its question ids, so a run made on one version of the stream is never resumed on another.
Bump :data:`GENERATOR_VERSION` with any change to the output and regenerate the file; the tests
check that the file is exactly what this module generates and pin its checksum to the version.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Changes whenever the generated text or answers change (the vendored file is regenerated).
GENERATOR_VERSION = "1"
#: The vendored file: ``generate(N_PROBLEMS, GENERATOR_SEED)``.
N_PROBLEMS = 1200
GENERATOR_SEED = 2026
ID_PREFIX = f"synth{GENERATOR_VERSION}"

Params = dict[str, Any]


@dataclass(frozen=True)
class Family:
    name: str
    steps: int  # arithmetic operations from the numbers to the answer
    templates: tuple[str, ...]
    sample: Callable[[random.Random], Params]
    solve: Callable[[Params], int]


@dataclass(frozen=True)
class SynthProblem:
    id: str
    question: str
    answer: int
    family: str
    structure: str
    params: Params

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "answer": str(self.answer),
            "family": self.family,
            "structure": self.structure,
        }


# ---- vocabulary (no digits anywhere: numbers in a question are the problem's numbers) ------------

_PEOPLE = [
    ("Maya", "she", "her"),
    ("Omar", "he", "his"),
    ("Lena", "she", "her"),
    ("Tom", "he", "his"),
    ("Priya", "she", "her"),
    ("Diego", "he", "his"),
    ("Aisha", "she", "her"),
    ("Ben", "he", "his"),
    ("Chloe", "she", "her"),
    ("Kenji", "he", "his"),
    ("Sofia", "she", "her"),
    ("Liam", "he", "his"),
    ("Nora", "she", "her"),
    ("Ravi", "he", "his"),
    ("Emma", "she", "her"),
    ("Jonas", "he", "his"),
]
_GOODS = ["notebooks", "mugs", "T-shirts", "books", "toy cars", "plant pots", "scarves", "board games"]
_FOOD = [
    ("apples", "pears"),
    ("muffins", "cookies"),
    ("bottles of juice", "bags of rice"),
    ("loaves of bread", "jars of honey"),
    ("pizzas", "salads"),
    ("sandwiches", "smoothies"),
]
_VEHICLES = ["bus", "train", "truck", "car", "van"]
_SHARED = [
    ("stickers", "packs", "friends"),
    ("marbles", "bags", "children"),
    ("cards", "boxes", "players"),
    ("beads", "tubes", "jars"),
]
_HOBBIES = ["practises the piano", "reads", "trains at the gym", "paints", "studies Spanish"]
_GROWTH = [
    ("bakery", "sold", "loaves of bread"),
    ("library", "lent", "books"),
    ("shop", "sold", "ice creams"),
    ("museum", "welcomed", "visitors"),
    ("farm", "collected", "eggs"),
]
_MAKERS = [("machine", "toys"), ("printer", "posters"), ("oven", "pies"), ("robot", "boxes")]
_RECIPES = [
    ("pancakes", "eggs"),
    ("muffins", "cups of milk"),
    ("cookies", "cups of flour"),
    ("bread rolls", "spoons of yeast"),
]
_THINGS = [("bike", "bike"), ("guitar", "guitar"), ("tablet", "tablet"), ("skateboard", "skateboard")]
_STOCK = [("pens", "boxes"), ("bottles", "crates"), ("cans", "cases"), ("candles", "packs")]


def _person(rng: random.Random, n: int = 1) -> list[tuple[str, str, str]]:
    return rng.sample(_PEOPLE, n)


def _hours(h: int) -> str:
    return f"{h} hour" if h == 1 else f"{h} hours"


# ---- the families ------------------------------------------------------------------------------


def _discount(rng: random.Random) -> Params:
    while True:
        n, p, d = rng.randint(2, 6), rng.randint(4, 25), rng.choice([10, 20, 25, 50])
        if n * p * d % 100 == 0:
            (a, _, _) = _person(rng)[0]
            return {"A": a, "n": n, "p": p, "d": d, "item": rng.choice(_GOODS)}


def _travel(rng: random.Random) -> Params:
    return {
        "v": rng.randint(3, 9) * 10,
        "t1": rng.randint(2, 5),
        "w": rng.randint(2, 8) * 10,
        "t2": rng.randint(2, 4),
        "vehicle": rng.choice(_VEHICLES),
    }


def _share(rng: random.Random) -> Params:
    while True:
        a, b, c, k = rng.randint(10, 40), rng.randint(2, 5), rng.randint(6, 12), rng.randint(3, 7)
        if (a + b * c) % k:
            (name, she, _) = _person(rng)[0]
            thing, packs, friends = rng.choice(_SHARED)
            return {
                "A": name,
                "She": she.capitalize(),
                "a": a,
                "b": b,
                "c": c,
                "k": k,
                "thing": thing,
                "packs": packs,
                "friends": friends,
            }


def _ages(rng: random.Random) -> Params:
    (a, _, _), (b, _, _), (c_name, _, _) = _person(rng, 3)
    return {
        "A": a,
        "B": b,
        "C": c_name,
        "c": rng.randint(3, 10),
        "d": rng.randint(2, 6),
        "k": rng.randint(2, 4),
        "y": rng.randint(2, 9),
    }


def _time(rng: random.Random) -> Params:
    (a, _, _) = _person(rng)[0]
    h = rng.randint(1, 3)
    return {
        "A": a,
        "h": h,
        "hours": _hours(h),
        "m": rng.choice([10, 15, 20, 25, 30, 40, 45, 50]),
        "days": rng.randint(3, 7),
        "hobby": rng.choice(_HOBBIES),
    }


def _growth(rng: random.Random) -> Params:
    place, verb, things = rng.choice(_GROWTH)
    return {
        "x": rng.randint(2, 12) * 20,
        "p": rng.choice([10, 20, 25, 50]),
        "place": place,
        "verb": verb,
        "things": things,
    }


def _together(rng: random.Random) -> Params:
    (a, _, _), (b, _, _) = _person(rng, 2)
    maker, goods = rng.choice(_MAKERS)
    x, y, h = rng.randint(4, 15), rng.randint(4, 15), rng.randint(2, 8)
    return {"A": a, "B": b, "a": x, "b": y, "h": h, "N": (x + y) * h, "maker": maker, "goods": goods}


def _average(rng: random.Random) -> Params:
    while True:
        avg = rng.randint(70, 90)
        s = [rng.randint(60, 100) for _ in range(3)]
        if 50 <= 4 * avg - sum(s) <= 100:
            (a, _, _) = _person(rng)[0]
            return {"A": a, "s1": s[0], "s2": s[1], "s3": s[2], "avg": avg}


def _change(rng: random.Random) -> Params:
    n1, p1, n2, p2 = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    cost = n1 * p1 + n2 * p2
    bill = next(b for b in (20, 50, 100) if b > cost)
    (a, _, _) = _person(rng)[0]
    item1, item2 = rng.choice(_FOOD)
    return {"A": a, "n1": n1, "p1": p1, "n2": n2, "p2": p2, "bill": bill, "item1": item1, "item2": item2}


def _recipe(rng: random.Random) -> Params:
    s, f, k = rng.choice([4, 6, 8, 10, 12]), rng.randint(2, 4), rng.randint(2, 5)
    (a, _, _) = _person(rng)[0]
    dish, ingredient = rng.choice(_RECIPES)
    return {"A": a, "s": s, "f": f, "t": s * k, "h": rng.randint(1, f * k - 1), "dish": dish, "ingredient": ingredient}


def _savings(rng: random.Random) -> Params:
    (a, _, _) = _person(rng)[0]
    weeks, w, s = rng.randint(3, 12), rng.randint(4, 15), rng.randint(5, 40)
    return {"A": a, "s": s, "w": w, "c": s + w * weeks, "thing": rng.choice(_THINGS)[0]}


def _stock(rng: random.Random) -> Params:
    while True:
        a, n, s = rng.randint(3, 9), rng.randint(6, 24), rng.randint(4, 30)
        if a * n - 3 * s > 0:
            things, boxes = rng.choice(_STOCK)
            return {"a": a, "n": n, "s": s, "things": things, "boxes": boxes}


FAMILIES: tuple[Family, ...] = (
    Family(
        "discount",
        3,
        (
            "{A} buys {n} {item} that cost ${p} each. The shop takes {d}% off the total price. "
            "How many dollars does {A} pay?",
            "Everything in a shop is {d}% off today. {A} picks {n} {item} priced at ${p} each. "
            "How much does {A} pay after the discount, in dollars?",
        ),
        _discount,
        lambda q: q["n"] * q["p"] * (100 - q["d"]) // 100,
    ),
    Family(
        "travel",
        3,
        (
            "A {vehicle} drives at {v} km/h for {t1} hours, then at {w} km/h for {t2} hours. "
            "How many kilometres does it travel in total?",
            "A {vehicle} travels for {t1} hours at a speed of {v} km/h. After a stop, it travels for {t2} more hours "
            "at {w} km/h. What is the total distance it travels, in kilometres?",
        ),
        _travel,
        lambda q: q["v"] * q["t1"] + q["w"] * q["t2"],
    ),
    Family(
        "share_remainder",
        3,
        (
            "{A} has {a} {thing} and buys {b} {packs} with {c} {thing} in each. {A} shares all the {thing} equally "
            "among {k} {friends}, giving each as many as possible. How many {thing} are left over?",
            "{A} has {b} {packs} of {c} {thing} and {a} loose {thing}. {She} splits all of them equally among {k} "
            "{friends} so that each gets the same number, as many as possible. How many {thing} are left over?",
        ),
        _share,
        lambda q: (q["a"] + q["b"] * q["c"]) % q["k"],
    ),
    Family(
        "ages",
        3,
        (
            "{C} is {c} years old. {B} is {d} years older than {C}. {A} is {k} times as old as {B}. "
            "How old will {A} be in {y} years?",
            "{B} is {d} years older than {C}, who is {c}. {A}'s age is {k} times {B}'s age. "
            "How old will {A} be {y} years from now?",
        ),
        _ages,
        lambda q: q["k"] * (q["c"] + q["d"]) + q["y"],
    ),
    Family(
        "time_units",
        3,
        (
            "{A} {hobby} for {hours} and {m} minutes every day. How many minutes does {A} spend on it in {days} days?",
            "Every day, {A} {hobby} for {hours} and {m} minutes. How many minutes is that in total over {days} days?",
        ),
        _time,
        lambda q: (60 * q["h"] + q["m"]) * q["days"],
    ),
    Family(
        "percent_growth",
        3,
        (
            "A {place} {verb} {x} {things} in May. In June it {verb} {p}% more {things} than in May. "
            "How many {things} did it {base} in May and June together?",
            "Last week a {place} {verb} {x} {things}. This week it {verb} {p}% more than last week. "
            "How many {things} did it {base} in the two weeks altogether?",
        ),
        _growth,
        lambda q: q["x"] + q["x"] * (100 + q["p"]) // 100,
    ),
    Family(
        "work_together",
        2,
        (
            "One {maker} makes {a} {goods} per hour and a second {maker} makes {b} {goods} per hour. "
            "Working together, how many hours do they need to make {N} {goods}?",
            "{A} can pack {a} boxes per hour and {B} can pack {b} boxes per hour. "
            "If they work together, how many hours will it take them to pack {N} boxes?",
        ),
        _together,
        lambda q: q["N"] // (q["a"] + q["b"]),
    ),
    Family(
        "average_needed",
        3,
        (
            "{A} scored {s1}, {s2} and {s3} on the first three tests. What score does {A} need on the fourth test "
            "to have an average of {avg} over all four tests?",
            "A team scored {s1}, {s2} and {s3} points in its first three games. How many points must it score in "
            "the fourth game so that its average over the four games is {avg} points?",
        ),
        _average,
        lambda q: 4 * q["avg"] - q["s1"] - q["s2"] - q["s3"],
    ),
    Family(
        "change",
        4,
        (
            "{A} buys {n1} {item1} at ${p1} each and {n2} {item2} at ${p2} each, and pays with a ${bill} bill. "
            "How much change does {A} get, in dollars?",
            "At the market, {A} gets {n1} {item1} for ${p1} each and {n2} {item2} for ${p2} each. {A} hands the "
            "cashier ${bill}. How many dollars of change should {A} receive?",
        ),
        _change,
        lambda q: q["bill"] - q["n1"] * q["p1"] - q["n2"] * q["p2"],
    ),
    Family(
        "recipe_scaling",
        3,
        (
            "A recipe for {s} {dish} uses {f} {ingredient}. {A} wants to make {t} {dish} and already has {h} "
            "{ingredient}. How many more {ingredient} does {A} need?",
            "To make {s} {dish} you need {f} {ingredient}. {A} is making {t} {dish} for a party and has {h} "
            "{ingredient} at home. How many more {ingredient} does {A} need?",
        ),
        _recipe,
        lambda q: q["f"] * q["t"] // q["s"] - q["h"],
    ),
    Family(
        "savings",
        2,
        (
            "{A} has saved ${s} and saves ${w} more every week. After how many weeks will {A} have exactly ${c} "
            "to buy a {thing}?",
            "A {thing} costs ${c}. {A} already has ${s} and puts aside ${w} every week. "
            "How many weeks will it take {A} to have exactly enough money to buy it?",
        ),
        _savings,
        lambda q: (q["c"] - q["s"]) // q["w"],
    ),
    Family(
        "stock",
        4,
        (
            "A shop has {a} {boxes} with {n} {things} in each. It sells {s} {things} on Monday and twice as many "
            "on Tuesday. How many {things} are left?",
            "A warehouse receives {a} {boxes} of {n} {things} each. It ships out {s} {things} on the first day and "
            "twice as many on the second day. How many {things} remain in the warehouse?",
        ),
        _stock,
        lambda q: q["a"] * q["n"] - 3 * q["s"],
    ),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)

_BASE_VERB = {"sold": "sell", "lent": "lend", "welcomed": "welcome", "collected": "collect"}


def _schedule(n: int, seed: int, families: int, name: str) -> list[int]:
    """Family index of each position: blocks that hold every family once, each block shuffled."""
    rng = random.Random(f"{name}-schedule:{seed}")
    order: list[int] = []
    while len(order) < n:
        block = list(range(families))
        rng.shuffle(block)
        order.extend(block)
    return order[:n]


def make_problem(family: Family, rng: random.Random, pid: str) -> SynthProblem:
    """One problem of ``family`` drawn from ``rng``."""
    params = family.sample(rng)
    variant = rng.randrange(len(family.templates))
    fields = dict(params)
    if "verb" in fields:
        fields["base"] = _BASE_VERB[fields["verb"]]
    text = family.templates[variant].format(**fields)
    text = text[0].upper() + text[1:]
    answer = family.solve(params)
    if not isinstance(answer, int) or answer < 0:  # the samplers guarantee this; never ship a bad gold
        raise AssertionError(f"{family.name}: gold answer {answer!r} from {params}")
    return SynthProblem(pid, text, answer, family.name, f"{family.name}.{variant}", params)


def generate(n: int, seed: int = GENERATOR_SEED) -> list[SynthProblem]:
    """``n`` problems, the same for the same ``(n, seed)``; no question twice. Problem ``i`` depends on
    ``seed``, ``i`` and (only when it would repeat an earlier question) the problems before it, never on ``n``."""
    return generate_stream(FAMILIES, n, seed, name="synth-arith", id_prefix=ID_PREFIX)


def generate_stream(
    families: tuple[Family, ...], n: int, seed: int, *, name: str, id_prefix: str
) -> list[SynthProblem]:
    """:func:`generate` for any family set; ``name`` seeds the schedule and each problem's draws."""
    if n < 1:
        raise ValueError("n must be at least 1")
    width = max(4, len(str(n - 1)))
    out: list[SynthProblem] = []
    seen: set[str] = set()
    for i, fam in enumerate(_schedule(n, seed, len(families), name)):
        rng = random.Random(f"{name}:{seed}:{i}")
        problem = make_problem(families[fam], rng, f"{id_prefix}-{i:0{width}d}")
        while problem.question in seen:  # no question twice in a stream: draw again from the same rng
            problem = make_problem(families[fam], rng, problem.id)
        seen.add(problem.question)
        out.append(problem)
    return out


def to_jsonl(problems: list[SynthProblem]) -> str:
    return "".join(json.dumps(p.row(), ensure_ascii=False) + "\n" for p in problems)


def vendored_path() -> Path:
    return Path(__file__).with_name("data") / "synth_arith.jsonl"


def generator_cli(prog: str, make: Callable[[int, int], list[SynthProblem]], n: int, seed: int, vendored: Path,
                  argv: list[str] | None) -> None:  # fmt: skip
    """Write ``make(--n, --seed)`` to ``--out``; to the vendored file, with its ``SHA256SUMS`` line in step."""
    import argparse
    import hashlib

    parser = argparse.ArgumentParser(prog=prog, description="Write a generated set (default: the vendored file).")
    parser.add_argument("--n", type=int, default=n)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--out", type=Path, default=vendored)
    args = parser.parse_args(argv)
    text, pinned = to_jsonl(make(args.n, args.seed)), args.out.resolve() == vendored.resolve()
    args.out.write_text(text, encoding="utf-8")
    if pinned:
        sums = args.out.with_name("SHA256SUMS")
        lines = [ln for ln in sums.read_text(encoding="utf-8").splitlines() if not ln.endswith(f"  {args.out.name}")]
        lines.append(f"{hashlib.sha256(text.encode('utf-8')).hexdigest()}  {args.out.name}")
        sums.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.n} problems to {args.out}" + (" and its SHA256SUMS line" if pinned else ""))


def main(argv: list[str] | None = None) -> None:
    generator_cli("python -m elm_memory.eval.synth", generate, N_PROBLEMS, GENERATOR_SEED, vendored_path(), argv)


if __name__ == "__main__":
    main()
