"""Paired comparisons of online methods: gains, losses and an exact sign test over distinct questions.

Pooling runs (seeds) that share questions: a question counts once. Its outcome is the sign of
(times the method was right - times the baseline was right) over the runs where both answered it,
so a question seen in three seeds cannot count as three independent wins. Ties (both right or both
wrong as often) carry no information for a sign test and are left out of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from math import comb
from typing import Any

__all__ = ["BASELINES", "head_to_head", "markdown_head_to_head", "paired_outcomes", "sign_test"]

#: what every ELM row is set against, where the run has it
BASELINES = ("zero_shot", "self_consistency", "maj_at_k", "elm_untrained")


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of ``wins`` against ``losses`` under p = 1/2 (1.0 with neither)."""
    if wins < 0 or losses < 0:
        raise ValueError(f"wins and losses must be >= 0, got {wins}, {losses}")
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_outcomes(
    runs: Iterable[Sequence[Mapping[str, Any]]], method: str, baseline: str
) -> dict[str, int | float] | None:
    """``method`` against ``baseline`` pooled over ``runs`` (each a run's records) by question id: wins,
    losses, ties, distinct questions and the sign test's p; None when no question has both."""
    net: dict[str, int] = {}
    for records in runs:
        mine = {r["question_id"]: bool(r["correct"]) for r in records if r["method"] == method}
        theirs = {r["question_id"]: bool(r["correct"]) for r in records if r["method"] == baseline}
        for qid in mine.keys() & theirs.keys():
            net[qid] = net.get(qid, 0) + int(mine[qid]) - int(theirs[qid])
    if not net:
        return None
    wins = sum(v > 0 for v in net.values())
    losses = sum(v < 0 for v in net.values())
    return {
        "questions": len(net),
        "wins": wins,
        "losses": losses,
        "ties": len(net) - wins - losses,
        "p": sign_test(wins, losses),
    }


def head_to_head(runs: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Every ELM method (``elm_*``) against every baseline of :data:`BASELINES` that the runs hold."""
    methods = list(dict.fromkeys(r["method"] for records in runs for r in records))
    rows = []
    for method in (m for m in methods if m.startswith("elm_")):
        for baseline in (b for b in BASELINES if b in methods and b != method):
            outcome = paired_outcomes(runs, method, baseline)
            if outcome is not None:
                rows.append({"method": method, "baseline": baseline, **outcome})
    return rows


def markdown_head_to_head(rows: Sequence[Mapping[str, Any]], label: str = "method") -> str:
    """The head-to-head rows as a Markdown table ('' when there are none); ``label`` heads the first column."""
    if not rows:
        return ""
    lines = [
        f"| {label} | against | distinct questions | gains | losses | ties | sign test p |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['baseline']} | {r['questions']} | +{r['wins']} | −{r['losses']} | {r['ties']} "
            f"| {r['p']:.3g} |"
        )
    return "\n".join(lines) + "\n"
