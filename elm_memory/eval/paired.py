"""Paired baselines read from an ELM method's own records: every comparison on the same generations.

An ELM record holds the greedy zero-shot answer, the memory's answer, the verifier's k zero-shot samples
(drawn ahead with the candidates; where ELM drew none, the evaluation drew them with the same seeds:
``extra.baseline_sample_answers``) and, with ``EvalRuntime.paired``, the answer of the retrieved memory
untrained (``extra.untrained_twin``: its initial soft prompt, the same retrieval). From these alone, per
question and with no model:

* ``zero_shot``: the greedy answer;
* ``self_consistency``: greedy plus the k samples, majority, ties to greedy (ELM's compute minus the memory);
* ``maj_at_k``: the k samples alone;
* ``memory``: the memory's answer alone, and ``untrained_memory``: the twin's (questions with a memory);
* ``sc_memory`` / ``sc_untrained_memory``: self-consistency with the memory's (the twin's) answer as one
  more vote, ties to greedy: the memory as a vote rather than a route (where no memory was retrieved,
  plain self-consistency);
* ``elm_untrained``: ELM's route replayed with the twin in place of the trained memory, scored by the
  ``consistency`` rule on the same samples (only where the run's verifier is ``consistency``; under
  ``verifier.route=vote`` the vote, i.e. ``sc_untrained_memory``);
* ``elm``: ELM's recorded answer.

The replay is checked against ELM itself: replaying the route with the *trained* memory's answer must
give the answer ELM recorded (``replay_mismatches``); a mismatch means the replay does not model that
run (e.g. extra tie samples), and its ``elm_untrained`` row should not be trusted.

Because all rows come from one run's generations, a difference between two of them is attributable:
``elm`` vs ``elm_untrained`` differs only in the memory's training, ``elm`` vs ``self_consistency`` only
in the memory candidate. Pooling runs (seeds) counts each distinct question once
(:func:`~elm_memory.eval.significance.paired_outcomes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.methods.voting import majority_vote
from elm_memory.eval.significance import markdown_head_to_head, paired_outcomes
from elm_memory.graph.routing import AGREE, ANSWERED, VERIFIER, ZERO_SHOT, memory_wins, route_of, voted_answer
from elm_memory.verifiers.consistency import agreement_scores

__all__ = [
    "VARIANTS",
    "ReplaySettings",
    "markdown_paired",
    "paired_answers",
    "paired_curves",
    "paired_summaries",
    "paired_summary",
    "replay_route",
    "replay_settings",
    "vote_samples",
]

#: the rows, in table order, and what each is (the module docstring has the long form)
MEANINGS = {
    "zero_shot": "the greedy answer",
    "self_consistency": "greedy + the k samples, majority, ties to greedy",
    "maj_at_k": "the k samples alone, majority",
    "memory": "the memory's answer alone",
    "untrained_memory": "the same memory untrained (its init)",
    "sc_memory": "self-consistency + the memory's vote (verifier.route=vote)",
    "sc_untrained_memory": "self-consistency + the untrained memory's vote",
    "elm_untrained": "ELM's route with the memory untrained",
    "elm": "ELM's recorded answer",
}
VARIANTS = tuple(MEANINGS)
#: (row, against) pairs of the head-to-head table: what each comparison isolates is in the module docstring
COMPARISONS = (
    ("elm", "zero_shot"),
    ("elm", "self_consistency"),
    ("elm", "maj_at_k"),
    ("elm", "elm_untrained"),
    ("memory", "untrained_memory"),
    ("memory", "zero_shot"),
    ("untrained_memory", "zero_shot"),
    ("sc_memory", "self_consistency"),
    ("sc_memory", "sc_untrained_memory"),
)


@dataclass(frozen=True)
class ReplaySettings:
    """What reading a run's records needs from its config: ``replay``, whether ELM's route can be replayed on
    the recorded samples (the verifier is ``consistency`` with no tie samples); ``prefer_answered``, the
    route's rule; ``k``, the samples a vote counts (the first k: tie samples come after them); ``vote``, the
    run routed by ``verifier.route=vote``."""

    replay: bool = True
    prefer_answered: bool = False
    k: int | None = None
    vote: bool = False


#: the columns of the breakdown by training majority share
SHARE_COLUMNS = ("memory", "untrained_memory", "zero_shot", "elm", "elm_untrained")


def replay_settings(config: Mapping[str, Any]) -> ReplaySettings:
    """A run's :class:`ReplaySettings` from its config (``run.json``'s, or ``ELMConfig.model_dump()``)."""
    verifier = config.get("verifier") or {}
    k = verifier.get("consistency_samples")
    return ReplaySettings(
        replay=verifier.get("name") == "consistency" and not verifier.get("consistency_tie_samples"),
        prefer_answered=bool(verifier.get("prefer_answered", False)),
        k=k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None,
        vote=verifier.get("route") == "vote",
    )


def replay_route(
    zero_shot: str | None,
    memory: str | None,
    samples: Sequence[str | None],
    *,
    prefer_answered: bool,
    vote: bool = False,
) -> str | None:
    """ELM's answer from two candidate answers and the ``consistency`` verifier's samples (no tie samples);
    with ``vote``, the vote's."""
    if vote:
        return voted_answer(zero_shot, samples, memory)
    route = route_of(zero_shot, memory, has_memory=True, prefer_answered=prefer_answered)
    if route in (ZERO_SHOT, AGREE):
        return zero_shot
    if route == ANSWERED:
        return zero_shot if zero_shot is not None else memory
    assert route == VERIFIER
    return memory if memory_wins(agreement_scores([zero_shot, memory], samples)) else zero_shot


def candidate(record: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    """The record's candidate of this kind (``zero_shot``, ``memory``), or None where it has none."""
    return next((c for c in record.get("candidates") or [] if c.get("kind") == kind), None)


def vote_samples(record: Mapping[str, Any], settings: ReplaySettings) -> list[str | None] | None:
    """The k sample answers the votes count on this record (None: the record has none): the evaluation's own
    draw where ELM drew none (also where the verifier scored no sample: []), else the verifier's; never a
    tie's extra draws."""
    extra = record.get("extra") or {}
    samples = extra.get("baseline_sample_answers") or extra.get("verifier_sample_answers")
    return None if samples is None else list(samples)[: settings.k]


def paired_answers(record: Mapping[str, Any], settings: ReplaySettings) -> dict[str, Any] | None:
    """Each variant's answer on this ELM record (a variant the record cannot give is absent), plus
    ``replay_ok`` (None where nothing was replayed). None: the record lacks a zero-shot candidate or samples."""
    greedy = candidate(record, "zero_shot")
    extra = record.get("extra") or {}
    samples = vote_samples(record, settings)
    if greedy is None or samples is None:
        return None
    zero = greedy.get("answer")
    prefer_answered, replay = settings.prefer_answered, settings.replay
    out: dict[str, Any] = {
        "zero_shot": zero,
        "self_consistency": majority_vote(samples, zero, with_greedy=True),
        "maj_at_k": majority_vote(samples),
        "elm": record.get("answer"),
        "replay_ok": None,
    }
    memory = candidate(record, "memory")
    if memory is None:  # no memory retrieved: ELM and its untrained twin answer alike (zero-shot, or the vote)
        if replay:  # (a row the run cannot give on the other questions is left out on these too)
            out["elm_untrained"] = out["self_consistency"] if settings.vote else zero
        out["sc_memory"] = out["sc_untrained_memory"] = out["self_consistency"]
        return out
    out["memory"] = memory.get("answer")
    out["sc_memory"] = majority_vote([*samples, out["memory"]], zero, with_greedy=True)
    twin = extra.get("untrained_twin")
    if twin is not None and not twin.get("skipped"):
        out["untrained_memory"] = twin.get("answer")
        out["sc_untrained_memory"] = majority_vote([*samples, out["untrained_memory"]], zero, with_greedy=True)
    if replay:
        replayed = replay_route(
            zero, memory.get("answer"), samples, prefer_answered=prefer_answered, vote=settings.vote
        )
        recorded = record.get("answer")
        out["replay_ok"] = replayed == recorded or bool(equivalent(replayed, recorded))
        if "untrained_memory" in out:
            out["elm_untrained"] = replay_route(
                zero, out["untrained_memory"], samples, prefer_answered=prefer_answered, vote=settings.vote
            )
    return out


def _outcome_records(
    records: Sequence[Mapping[str, Any]], method: str, settings: ReplaySettings
) -> tuple[list[dict[str, Any]], dict[str, int], list[float]]:
    """One pseudo-record per (variant, question) with its correctness, the counts of what was read, and how
    far each used memory had moved from its init (relative norm)."""
    rows: list[dict[str, Any]] = []
    moves: list[float] = []
    counts: dict[str, int] = {
        "records": 0,
        "paired": 0,
        "with_memory": 0,
        "with_twin": 0,
        "replayed": 0,
        "replay_mismatches": 0,
    }
    for r in records:
        if r.get("method") != method:
            continue
        counts["records"] += 1
        answers = paired_answers(r, settings)
        if answers is None:
            continue
        counts["paired"] += 1
        counts["with_memory"] += "memory" in answers
        counts["with_twin"] += "untrained_memory" in answers
        moved = ((r.get("extra") or {}).get("untrained_twin") or {}).get("moved")
        if isinstance(moved, (int, float)):
            moves.append(float(moved))
        if answers["replay_ok"] is not None:
            counts["replayed"] += 1
            counts["replay_mismatches"] += not answers["replay_ok"]
        share = ((r.get("extra") or {}).get("memory_votes") or {}).get("majority_share")
        for variant in VARIANTS:
            if variant in answers:
                right = bool(equivalent(answers[variant], r["gold"]))
                rows.append(
                    {
                        "method": variant,
                        "question_id": r["question_id"],
                        "correct": right,
                        "with_memory": "memory" in answers,
                        "share": share,
                    }
                )
    return rows, counts, moves


def _by_share(per_run: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """On questions with a memory, by the memory's training majority share (its last step): how often each
    variant was right. Whether weak-consensus memories hurt is read here (no sign test: a breakdown)."""
    buckets: dict[float | None, dict[str, list[bool]]] = {}
    for rows in per_run:
        for row in rows:
            if row["with_memory"] and row["method"] in SHARE_COLUMNS:
                share = None if row["share"] is None else round(float(row["share"]), 2)
                buckets.setdefault(share, {}).setdefault(row["method"], []).append(row["correct"])
    return [
        {"majority_share": share, **{m: [sum(v), len(v)] for m, v in buckets[share].items()}}
        for share in sorted(buckets, key=lambda x: (x is None, x or 0.0))
    ]


def paired_summary(
    runs: Sequence[Sequence[Mapping[str, Any]]], method: str, settings: ReplaySettings | None = None
) -> dict[str, Any] | None:
    """``method``'s paired rows pooled over ``runs`` (each a run's records): per variant right / judged,
    and the :data:`COMPARISONS` as sign tests over distinct questions. None: no record can be paired."""
    per_run = []
    totals: dict[str, int] = {}
    moves: list[float] = []
    for records in runs:
        rows, counts, moved = _outcome_records(records, method, settings or ReplaySettings())
        per_run.append(rows)
        moves += moved
        for key, n in counts.items():
            totals[key] = totals.get(key, 0) + n
    if not totals.get("paired"):
        return None
    accuracy = {}
    for variant in VARIANTS:
        judged = [row["correct"] for rows in per_run for row in rows if row["method"] == variant]
        if judged:
            accuracy[variant] = {"right": sum(judged), "judged": len(judged)}
    comparisons = []
    for a, b in COMPARISONS:
        outcome = paired_outcomes(per_run, a, b)
        if outcome is not None:
            comparisons.append({"method": a, "baseline": b, **outcome})
    return {
        "method": method,
        "runs": len(runs),
        **totals,
        "accuracy": accuracy,
        "comparisons": comparisons,
        "by_majority_share": _by_share(per_run),
        "mean_moved": sum(moves) / len(moves) if moves else None,
        # a memory every step of which skipped its update (weak rollout majorities) is its init exactly
        "never_moved": sum(m == 0.0 for m in moves),
        "with_moved": len(moves),
    }


def paired_summaries(
    runs: Sequence[Sequence[Mapping[str, Any]]], methods: Sequence[str], config: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The :func:`paired_summary` of each ELM method (``elm_*``) of ``methods`` that has pairable records,
    pooled over ``runs`` made with ``config`` (a run's ``run.json`` config)."""
    settings = replay_settings(config)
    summaries = (paired_summary(runs, m, settings) for m in methods if m.startswith("elm_"))
    return [s for s in summaries if s is not None]


#: the paired rows drawn beside each ELM method in the accuracy plot, with their legend labels
CURVES = {"self_consistency": "self-consistency", "elm_untrained": "memory untrained"}


def paired_curves(
    records: Sequence[Mapping[str, Any]], methods: Sequence[str], config: Mapping[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """The :data:`CURVES` rows of each ELM method as records (``index``, ``correct``) to plot beside it,
    keyed ``"METHOD: label"``; a question a row cannot be read on is left out of that row's curve."""
    settings = replay_settings(config)
    curves: dict[str, list[dict[str, Any]]] = {}
    for method in (m for m in methods if m.startswith("elm_")):
        for r in records:
            if r.get("method") != method or (answers := paired_answers(r, settings)) is None:
                continue
            for variant, label in CURVES.items():
                if variant in answers:
                    right = bool(equivalent(answers[variant], r["gold"]))
                    curves.setdefault(f"{method}: {label}", []).append({"index": r["index"], "correct": right})
    return curves


def markdown_paired(summary: Mapping[str, Any]) -> str:
    """The paired summary as two Markdown tables (accuracy per variant, then head to head)."""
    lines = [
        f"Paired on {summary['method']}'s own generations ({summary['runs']} run(s); {summary['paired']} of "
        f"{summary['records']} records paired, {summary['with_memory']} with a memory, {summary['with_twin']} "
        f"with its untrained twin; route replay reproduced ELM's answer on "
        f"{summary['replayed'] - summary['replay_mismatches']} of {summary['replayed']}"
        + (
            f"; the memories used sat {100 * summary['mean_moved']:.1f}% of their norm from their init, on average"
            + (
                f", {summary['never_moved']} of {summary['with_moved']} never moved"
                if summary.get("never_moved")
                else ""
            )
            if summary.get("mean_moved") is not None
            else ""
        )
        + "):",
        "",
        "| variant | what it is | right | judged | accuracy (%) |",
        "|---|---|---:|---:|---:|",
    ]
    for variant, a in summary["accuracy"].items():
        meaning = MEANINGS.get(variant, "")
        lines.append(f"| {variant} | {meaning} | {a['right']} | {a['judged']} | {100 * a['right'] / a['judged']:.1f} |")
    lines += ["", markdown_head_to_head(summary["comparisons"], label="row").rstrip("\n")]
    if summary.get("by_majority_share"):
        lines += [
            "",
            "Questions with a memory, by the memory's training majority share (right / answered, each run's"
            " questions counted apart; a memory without recorded votes: none):",
            "",
            "| majority share | memory | untrained memory | zero-shot | ELM | ELM untrained |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for b in summary["by_majority_share"]:
            cells = [_fraction(b.get(m)) for m in SHARE_COLUMNS]
            share = "none" if b["majority_share"] is None else f"{b['majority_share']:.2f}"
            lines.append(f"| {share} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fraction(cell: Sequence[int] | None) -> str:
    return "" if cell is None else f"{cell[0]}/{cell[1]}"
