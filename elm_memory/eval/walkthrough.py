"""The main job's per-question printout: ELM next to zero-shot, and why ELM answered as it did.

For each question, once every method's record is in: the gold answer, zero-shot's answer, the
compute-matched baselines' answers (``others``, e.g. self-consistency with its votes; or, with ``paired``,
self-consistency and the untrained memory read from ELM's own record, :mod:`elm_memory.eval.paired`),
ELM's route, the memory it used (the stream question it was learned from, similarity,
training majority share) or the gate that kept a memory out, both of ELM's candidate
answers, and which were right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.methods.voting import vote_counts
from elm_memory.eval.paired import ReplaySettings, candidate, paired_answers, vote_samples

MARK = {True: "✓", False: "✗"}


class Walkthrough:
    """``on_record`` callback for :func:`elm_memory.eval.online.run_stream` (writes with ``echo``)."""

    def __init__(
        self,
        total: int,
        echo: Callable[[str], None],
        *,
        baseline: str = "zero_shot",
        method: str = "elm_input",
        others: Sequence[str] = (),
        paired: ReplaySettings | None = None,
    ):
        """``paired``: the run's :func:`~elm_memory.eval.paired.replay_settings`, to show the paired rows
        from ELM's record; None: show only the ``others`` methods' records."""
        self.total, self.echo = total, echo
        self.paired = paired
        self.baseline, self.method, self.others = baseline, method, tuple(others)
        self._pending: dict[int, dict[str, dict[str, Any]]] = {}
        self._learned_from: dict[str, dict[str, Any]] = {}  # memory id -> record of its question

    def __call__(self, record: dict[str, Any]) -> None:
        if record["method"] == self.method:
            job = (record.get("extra") or {}).get("learn_job") or {}
            if job.get("memory_id"):
                self._learned_from[job["memory_id"]] = record
        row = self._pending.setdefault(record["index"], {})
        row[record["method"]] = record
        if all(m in row for m in (self.baseline, self.method, *self.others)):
            self.echo(self.describe(row[self.baseline], row[self.method], [row[m] for m in self.others]))
            del self._pending[record["index"]]

    def describe(self, zero: dict[str, Any], elm: dict[str, Any], others: Sequence[dict[str, Any]] = ()) -> str:
        question = " ".join(elm["question"].split())
        lines = [
            f"[{elm['index'] + 1}/{self.total}] {elm['question_id']}  gold {elm['gold']}",
            f"    {_short(question, 110)}",
            f"    zero-shot {elm_answer(zero):>10} {MARK[zero['correct']]}",
        ]
        for other in others:  # a voting baseline: its answer and the votes that chose it
            votes = (other.get("extra") or {}).get("votes") or []
            shown = ", ".join(f"{a} x{n}" for a, n in votes) or "no boxed answer"
            label = {"self_consistency": "self-cons.", "maj_at_k": "maj@k"}.get(other["method"], other["method"])
            lines.append(f"    {label:<10}{elm_answer(other):>10} {MARK[other['correct']]}  votes {shown}")
        if self.paired is not None:
            lines += self._paired_lines(elm)
        route = f"route {elm['route']}"
        memory = candidate(elm, "memory")
        if elm["route"] == "vote" and memory is not None:  # verifier.route=vote: self-consistency's votes + one
            route += f" (the votes above and the memory's {memory.get('answer')!s})"
        lines.append(f"    ELM       {elm_answer(elm):>10} {MARK[elm['correct']]}  {route}")
        lines.append("              " + self._memory_line(elm))
        extra = elm.get("extra") or {}
        candidates = elm.get("candidates") or []
        if len(candidates) > 1:
            shown = "  |  ".join(
                f"{c['kind'].replace('_', '-')} {c.get('answer')!s} {MARK[bool(c.get('correct'))]}"
                + (f" (score {c['score']:.3f})" if c.get("score") is not None else "")
                for c in candidates
            )
            drawn = extra.get("verifier_samples")
            if drawn is not None:  # a sampling verifier: the score is agreeing samples / samples drawn
                shown += f"  ({drawn} samples)"
            lines.append(f"              candidates: {shown}")
        t = elm.get("timings") or {}
        if extra.get("overlap"):  # learned alongside: "learn" is the time after the answer
            lines.append(
                f"              answer {t.get('answer', 0):.0f}s (memory learned alongside), "
                f"then learning {t.get('learn', 0):.0f}s more"
            )
        else:
            lines.append(f"              answer {t.get('answer', 0):.0f}s, learn {t.get('learn', 0):.0f}s")
        return "\n".join(lines)

    def _paired_lines(self, elm: dict[str, Any]) -> list[str]:
        """Self-consistency (greedy + ELM's samples) and the untrained memory, from ELM's own record."""
        assert self.paired is not None
        answers = paired_answers(elm, self.paired)
        if answers is None:
            return []
        votes = vote_counts([answers["zero_shot"], *(vote_samples(elm, self.paired) or [])])
        shown = ", ".join(f"{a} x{n}" for a, n, _ in votes) or "no boxed answer"
        lines = [f"    self-cons.{_shown(answers['self_consistency'], elm['gold'])}  votes {shown}"]
        if "untrained_memory" in answers:
            line = f"    untrained {_shown(answers['untrained_memory'], elm['gold'])}  (the same memory before training"
            if "elm_untrained" in answers:
                line += f"; ELM with it: {_shown(answers['elm_untrained'], elm['gold']).strip()}"
            lines.append(line + ")")
        return lines

    def _memory_line(self, elm: dict[str, Any]) -> str:
        gate = (elm.get("extra") or {}).get("gate") or {}
        share = gate.get("majority_share")
        if elm.get("memory_id"):
            source = self._learned_from.get(elm["memory_id"])
            origin = f"from Q{source['index'] + 1} ({source['question_id']})" if source else "from an earlier run"
            parts = [f"memory {elm['memory_id'][:8]} {origin}", f"similarity {elm['similarity']:.3f}"]
            if share is not None:
                parts.append(f"majority share {share:.2f}")
            return ", ".join(parts)
        decision = gate.get("decision")
        if decision in (None, "empty_pool"):
            return "no memory yet (empty pool)"
        detail = f"best candidate similarity {gate['similarity']:.3f}" if gate.get("similarity") is not None else ""
        if decision == "weak_majority" and share is not None:
            detail += f", majority share {share:.2f} < {gate.get('threshold')}"
        elif gate.get("threshold") is not None:
            detail += f" < {gate['threshold']}"
        return f"no memory used: {decision.replace('_', ' ')}" + (f" ({detail})" if detail else "")


def _shown(answer: str | None, gold: str) -> str:
    text = "(none)" if answer is None else _short(str(answer), 10)
    return f"{text:>10} {MARK[bool(equivalent(answer, gold))]}"


def elm_answer(record: dict[str, Any]) -> str:
    answer = record.get("answer")
    return "(none)" if answer is None else _short(str(answer), 10)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
