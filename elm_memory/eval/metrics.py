"""Metrics of the evaluation harness: pure functions over plain records, no I/O, no model.

Two kinds of input:

* **online records**, one dict per (method, question), as written by the online runner
  (keys ``method``, ``index``, ``question_id``, ``correct``, ``route``, ``timings``, ``pool_size``,
  ``pool_bytes``, ``warnings``, ...);
* **offline correctness**: ``zs`` maps question id -> zero-shot correct, and ``per_memory`` maps
  memory id -> question id -> correct with that memory injected.

Everything returned is JSON-serialisable (str keys, floats, ints, ``None``) so a summary can be
written next to the records and reported again later without recomputing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

Record = Mapping[str, Any]
Correctness = Mapping[str, bool]

__all__ = [
    "accuracy",
    "improved_set",
    "iou",
    "negative_flip_rate",
    "oracle_accuracy",
    "ordered_records",
    "route_counts",
    "running_accuracy",
    "summarize_offline",
    "summarize_online",
]


# --- validation helpers -------------------------------------------------------------------------


def _flag(value: Any, where: str) -> bool:
    """A correctness flag as a real bool; rejects strings/None so a bad record fails loudly."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if type(value).__name__ == "bool_":  # numpy.bool_ without importing numpy
        return bool(value)
    raise ValueError(f"{where}: correctness must be a bool, got {value!r}")


def _correct(record: Record) -> bool:
    if "correct" not in record:
        raise ValueError(f"record {_describe(record)} has no 'correct' field")
    return _flag(record["correct"], f"record {_describe(record)}")


def _index(record: Record) -> int:
    value = record.get("index")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"record {_describe(record)} needs an integer 'index', got {value!r}")
    return value


def _describe(record: Record) -> str:
    return f"(method={record.get('method')!r}, index={record.get('index')!r})"


def _seconds(record: Record, key: str) -> float:
    """A timing in seconds; a missing or null timing counts as 0 (e.g. zero-shot never learns)."""
    timings = record.get("timings") or {}
    value = timings.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"record {_describe(record)}: timings[{key!r}] must be a number, got {value!r}")
    return float(value)


def ordered_records(records: Iterable[Record]) -> list[Record]:
    """Records in stream order; duplicate indices mean two methods (or runs) were mixed."""
    rows = list(records)
    seen: set[int] = set()
    for record in rows:
        i = _index(record)
        if i in seen:
            raise ValueError(
                f"duplicate index {i} in records of one stream; group records by method first "
                f"(a resumed run may have written a question twice)"
            )
        seen.add(i)
    return sorted(rows, key=_index)


def _checked(name: str, mapping: Correctness) -> dict[str, bool]:
    return {str(q): _flag(v, f"{name}[{q!r}]") for q, v in mapping.items()}


def _pairs(zs: Correctness, mem: Correctness) -> list[tuple[bool, bool]]:
    """(zero-shot, memory) correctness over the questions present in both, in a fixed order."""
    z, m = _checked("zs", zs), _checked("mem", mem)
    return [(z[q], m[q]) for q in sorted(z.keys() & m.keys())]


def _acc(correct: int, n: int) -> float:
    return correct / n


# --- online metrics -----------------------------------------------------------------------------


def accuracy(records: Iterable[Record]) -> float:
    """Fraction of records marked correct (an unanswered question counts as wrong)."""
    flags = [_correct(r) for r in records]
    if not flags:
        raise ValueError("accuracy of no records is undefined: the record list is empty")
    return _acc(sum(flags), len(flags))


def running_accuracy(records: Iterable[Record]) -> list[float]:
    """Cumulative accuracy after each question, in ``index`` order: the online learning curve.

    Give it the records of one method; an empty input gives an empty curve.
    """
    curve: list[float] = []
    correct = 0
    for n, record in enumerate(ordered_records(records), start=1):
        correct += _correct(record)
        curve.append(_acc(correct, n))
    return curve


def route_counts(records: Iterable[Record]) -> dict[str, int]:
    """How often each route decided the answer; a missing route is counted as ``"unknown"``."""
    counts = Counter(str(r.get("route") or "unknown") for r in records)
    return dict(sorted(counts.items()))


# --- offline metrics ----------------------------------------------------------------------------


def negative_flip_rate(zs: Correctness, mem: Correctness) -> float | None:
    """#(right->wrong) / (#(right->wrong) + #(wrong->right)) when the memory is injected.

    The paper's footnote definition: the share of changed answers that the memory broke. Only
    questions present in both mappings count; ``None`` when no answer flipped (the ratio is 0/0).
    """
    negative = positive = 0
    for z, m in _pairs(zs, mem):
        negative += z and not m
        positive += m and not z
    flips = negative + positive
    return None if flips == 0 else negative / flips


def improved_set(zs: Correctness, mem: Correctness) -> set[str]:
    """Questions the memory fixes: zero-shot wrong, memory right (questions in both mappings)."""
    z, m = _checked("zs", zs), _checked("mem", mem)
    return {q for q in z.keys() & m.keys() if m[q] and not z[q]}


def iou(a: set[Any], b: set[Any]) -> float | None:
    """Intersection over union; ``None`` when both sets are empty (nothing to compare)."""
    union = a | b
    if not union:
        return None
    return len(a & b) / len(union)


def oracle_accuracy(zs: Correctness, mem: Correctness) -> float:
    """Accuracy of an oracle that picks the right one of zero-shot and memory answers (Table 1).

    Computed over the questions present in both mappings; an upper bound for any router.
    """
    pairs = _pairs(zs, mem)
    if not pairs:
        raise ValueError("oracle accuracy needs questions evaluated both zero-shot and with the memory; none overlap")
    return _acc(sum(z or m for z, m in pairs), len(pairs))


# --- summaries ----------------------------------------------------------------------------------


def _group_by_method(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records per method, methods in order of first appearance (the order reports use)."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        method = record.get("method")
        if not isinstance(method, str) or not method:
            raise ValueError(f"record {_describe(record)} needs a non-empty string 'method'")
        groups.setdefault(method, []).append(record)
    return groups


def _summarize_method(rows: Sequence[Record]) -> dict[str, Any]:
    ordered = ordered_records(rows)
    n = len(ordered)
    correct = sum(_correct(r) for r in ordered)
    answer = sum(_seconds(r, "answer") for r in ordered)
    learn = sum(_seconds(r, "learn") for r in ordered)
    last = ordered[-1]
    return {
        "n": n,
        "correct": correct,
        "accuracy": _acc(correct, n),
        "unanswered": sum(r.get("answer") is None for r in ordered),
        "routes": route_counts(ordered),
        "answer_seconds_total": answer,
        "answer_seconds_mean": answer / n,
        "learn_seconds_total": learn,
        "learn_seconds_mean": learn / n,
        "pool_size": int(last.get("pool_size") or 0),
        "pool_bytes": int(last.get("pool_bytes") or 0),
        "warnings": sum(len(r.get("warnings") or ()) for r in ordered),
        **_zero_shot_candidate(ordered),
    }


def _zero_shot_candidate(rows: Sequence[Record]) -> dict[str, Any]:
    """For methods that also produce a zero-shot candidate (ELM's dual generation): its accuracy
    on the same stream, and how often the method's final answer differs from it for better
    (``gains``: zero-shot wrong, final right) or worse (``losses``). None when not available."""
    zs = []
    for r in rows:
        cand = next((c for c in r.get("candidates") or () if c.get("kind") == "zero_shot" and "correct" in c), None)
        if cand is None:
            return {"zero_shot_candidate_accuracy": None, "gains": None, "losses": None}
        zs.append(bool(cand["correct"]))
    final = [_correct(r) for r in rows]
    return {
        "zero_shot_candidate_accuracy": _acc(sum(zs), len(zs)),
        "gains": sum(f and not z for f, z in zip(final, zs, strict=True)),
        "losses": sum(z and not f for f, z in zip(final, zs, strict=True)),
    }


def summarize_online(records: Iterable[Record]) -> dict[str, dict[str, Any]]:
    """One summary per method, keyed by method name in order of first appearance.

    Means are per question (a question that learned nothing adds 0 s), and the pool figures are
    those after the last question (highest ``index``), i.e. the pool the method ended with.
    """
    groups = _group_by_method(records)
    if not groups:
        raise ValueError("cannot summarise an online run with no records")
    return {method: _summarize_method(rows) for method, rows in groups.items()}


def _normalized_memories(z: dict[str, bool], per_memory: Mapping[str, Correctness]) -> dict[str, dict[str, bool]]:
    """Checked per-memory results; every memory must cover at least one question, all known to ``zs``."""
    memories: dict[str, dict[str, bool]] = {}
    for memory_id, results in per_memory.items():
        m = _checked(f"per_memory[{memory_id!r}]", results)
        if not m:
            raise ValueError(f"memory {memory_id!r} was evaluated on no questions")
        missing = sorted(m.keys() - z.keys())
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"memory {memory_id!r} was evaluated on {len(missing)} question(s) with no zero-shot result: {shown}"
            )
        memories[str(memory_id)] = m
    return memories


def _memory_rows(z: dict[str, bool], memories: Mapping[str, dict[str, bool]]) -> list[dict[str, Any]]:
    """Per-memory accuracy and paired delta vs zero-shot, ranked best first (ties: memory id)."""
    rows: list[dict[str, Any]] = []
    for memory_id, m in memories.items():
        correct = sum(m.values())
        zs_correct = sum(z[q] for q in m)
        rows.append(
            {
                "id": memory_id,
                "n": len(m),
                "correct": correct,
                "accuracy": _acc(correct, len(m)),
                # Exact fractions for ranking and "strictly better", floats for the report.
                "_exact": Fraction(correct, len(m)),
                "_delta": Fraction(correct - zs_correct, len(m)),
                "delta": (correct - zs_correct) / len(m),
            }
        )
    rows.sort(key=lambda row: (-row["_exact"], row["id"]))
    return rows


#: seeded half splits :func:`held_out_best_memory` averages over (``elm offline``'s summary uses this)
HELD_OUT_SPLITS = 1000


def held_out_best_memory(
    z: Mapping[str, bool], memories: Mapping[str, Mapping[str, bool]], splits: int = HELD_OUT_SPLITS, seed: int = 0
) -> dict[str, Any] | None:
    """The best memory's gain over zero-shot without the winner's curse: pick the best memory on a random
    half of the questions, score it on the other half against zero-shot there, and average over ``splits``
    seeded splits (tied best memories count equally). The in-sample best of many memories beats zero-shot
    by chance alone; this says whether the pick carries to questions it was not picked on. Only questions
    every memory was evaluated on count; None with fewer than two such questions or no memory."""
    import random

    shared = sorted(set(z).intersection(*(m.keys() for m in memories.values()))) if memories else []
    if len(shared) < 2:
        return None
    rng = random.Random(seed)
    gains: list[float] = []
    for _ in range(splits):
        order = rng.sample(shared, len(shared))
        pick, held = order[: len(order) // 2], order[len(order) // 2 :]
        on_pick = {mid: sum(m[q] for q in pick) for mid, m in memories.items()}
        top = max(on_pick.values())
        tied = [mid for mid, n in on_pick.items() if n == top]
        zero = sum(z[q] for q in held)
        gains.append(sum(sum(memories[mid][q] for q in held) - zero for mid in tied) / (len(tied) * len(held)))
    return {
        "splits": splits,
        "questions": len(shared),
        "mean_gain": sum(gains) / len(gains),
        "share_better": sum(g > 0 for g in gains) / len(gains),
        "share_worse": sum(g < 0 for g in gains) / len(gains),
    }


def summarize_offline(zs: Correctness, per_memory: Mapping[str, Correctness], top_flip: int = 5) -> dict[str, Any]:
    """The offline study: does a single memory help the whole benchmark, and how consistently?

    A memory's delta is paired: its accuracy minus zero-shot accuracy on the same questions it was
    evaluated on (identical to the global difference when every memory saw every question).
    """
    if isinstance(top_flip, bool) or not isinstance(top_flip, int) or top_flip < 0:
        raise ValueError(f"top_flip must be a non-negative integer, got {top_flip!r}")
    z = _checked("zs", zs)
    if not z:
        raise ValueError("offline summary needs zero-shot results for at least one question; zs is empty")
    memories = _normalized_memories(z, per_memory)
    rows = _memory_rows(z, memories)
    zero_shot = _acc(sum(z.values()), len(z))
    best = rows[0] if rows else None
    top = rows[:top_flip]
    flips = {row["id"]: negative_flip_rate(z, memories[row["id"]]) for row in top}
    defined = [rate for rate in flips.values() if rate is not None]
    improved = [improved_set(z, memories[row["id"]]) for row in rows[:2]]
    return {
        "n_questions": len(z),
        "n_memories": len(rows),
        "zero_shot_accuracy": zero_shot,
        "memories": [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
        "memory_accuracy": {row["id"]: row["accuracy"] for row in rows},
        "best_memory": None if best is None else {"id": best["id"], "accuracy": best["accuracy"]},
        "best_memory_held_out": held_out_best_memory(z, memories),
        "mean_memory_accuracy": sum(r["accuracy"] for r in rows) / len(rows) if rows else None,
        "fraction_improving": sum(r["_delta"] > 0 for r in rows) / len(rows) if rows else None,
        "oracle_accuracy": None if best is None else oracle_accuracy(z, memories[best["id"]]),
        "top_flip": top_flip,
        "negative_flip_rates": flips,
        "mean_negative_flip_rate": sum(defined) / len(defined) if defined else None,
        "iou_top2": iou(improved[0], improved[1]) if len(improved) == 2 else None,
        "deltas": [row["delta"] for row in rows],
    }
