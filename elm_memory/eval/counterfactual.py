"""Self-consistency counterfactuals read from an online run's ELM records (no model, no sampling).

Where an ELM record carries the verifier's sample answers (drawn ahead with the candidates, or after
the candidates disagreed), the answer plain self-consistency would have given on that question is
known exactly: the greedy (zero-shot) candidate plus those samples, majority vote, ties to greedy
(:func:`~elm_memory.eval.methods.voting.majority_vote`). Comparing it with ELM's answer says how often
the memory changed anything a vote would not have. Questions without samples (no memory retrieved)
are counted but not judged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.methods.voting import majority_vote

__all__ = ["markdown_counterfactuals", "self_consistency_counterfactual"]


def self_consistency_counterfactual(records: Iterable[Mapping[str, Any]], method: str) -> dict[str, Any] | None:
    """For ``method``'s records: how many carry samples, on how many the vote picks ELM's answer, and
    the questions ELM got right where the vote was wrong (gains) and the reverse (losses). None: the
    method has no record with samples (e.g. recorded before records kept them)."""
    mine = [r for r in records if r.get("method") == method]
    judged = same = gains = losses = vote_right = elm_right = 0
    for r in mine:
        samples = (r.get("extra") or {}).get("verifier_sample_answers")
        greedy = next((c for c in r.get("candidates") or [] if c.get("kind") == "zero_shot"), None)
        if samples is None or greedy is None:
            continue
        judged += 1
        vote = majority_vote(samples, greedy.get("answer"), with_greedy=True)
        right = bool(equivalent(vote, r["gold"]))
        vote_right += right
        elm_right += bool(r["correct"])
        same += bool(equivalent(vote, r.get("answer"))) or (vote is None and r.get("answer") is None)
        gains += bool(r["correct"]) and not right
        losses += right and not bool(r["correct"])
    if not judged:
        return None
    return {
        "method": method,
        "questions": len(mine),
        "with_samples": judged,
        "same_answer": same,
        "vote_correct": vote_right,
        "elm_correct": elm_right,
        "gains": gains,
        "losses": losses,
    }


def markdown_counterfactuals(rows: Iterable[Mapping[str, Any]]) -> str:
    rows = list(rows)
    if not rows:
        return ""
    lines = [
        "| method | questions | with samples | vote = ELM's answer | ELM right | vote right | gains/losses vs vote |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['questions']} | {r['with_samples']} | {r['same_answer']} | {r['elm_correct']} "
            f"| {r['vote_correct']} | +{r['gains']}/−{r['losses']} |"
        )
    return "\n".join(lines) + "\n"
