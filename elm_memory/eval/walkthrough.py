"""The main job's per-question printout: ELM next to zero-shot, and why ELM answered as it did.

For each question, once every method's record is in: the gold answer, zero-shot's answer, the
compute-matched baselines' answers (``others``, e.g. self-consistency with its votes; or, with ``paired``,
self-consistency and the untrained memory read from ELM's own record, :mod:`elm_memory.eval.paired`),
ELM's route, the memory it used (the stream question it was learned from, similarity,
training majority share) or the gate that kept a memory out, both of ELM's candidate
answers, and which were right. :class:`AmortizedWalkthrough` does the same for ``elm_amortized`` (every row,
its tokens, the turn's mode and the gate). After the questions, :func:`summary_table` and
:func:`amortized_summary` are the demo's one closing table (``elm report`` prints the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.methods.voting import vote_counts
from elm_memory.eval.paired import MEANINGS, ReplaySettings, candidate, paired_answers, paired_summaries, vote_samples

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


#: what each ``elm_amortized`` mode answered with (``StreamTurn.mode``)
MODES = {
    "self_consistency": "the vote answered (gate closed); the memory's answer was drawn for the gate",
    "memory": "the memory's greedy answer alone",
    "memory_probe": "the memory's answer; the vote drawn beside it for the gate (a probe)",
    "memory_fallback": "the memory's answer had no \\boxed{}: the vote answered",
}
#: a probed question's reading by the gate (``GateReading.outcome``)
OUTCOMES = {
    "win": "only the memory agreed with the samples' vote",
    "loss": "only zero-shot agreed with the samples' vote",
    "tie": "both or neither agreed with the samples' vote",
    "no_vote": "the samples' vote was tied: no reading",
}


class AmortizedWalkthrough:
    """``on_record`` callback for ``elm_amortized`` (``elm demo --amortized``): per question the gold answer, every
    row's answer and tokens (zero-shot, self-consistency with its votes, the memory's greedy answer, ELM's), ELM's
    mode, the gate's state, its reading of the question and any decision it made."""

    def __init__(self, total: int, echo: Callable[[str], None], *, method: str = "elm_amortized"):
        self.total, self.echo, self.method = total, echo, method

    def __call__(self, record: dict[str, Any]) -> None:
        if record["method"] == self.method and ((record.get("extra") or {}).get("amortized") or {}).get("rows"):
            self.echo(self.describe(record))

    def describe(self, record: Mapping[str, Any]) -> str:
        a = record["extra"]["amortized"]
        rows, tokens, turn, gold = a["rows"], a["tokens"], a["turn"], record["gold"]
        question = " ".join(record["question"].split())
        votes = vote_counts([rows["zero_shot"], *(a.get("samples") or [])])
        shown = ", ".join(f"{v} x{n}" for v, n, _ in votes) or "no boxed answer"
        mode = turn.get("mode") or "?"
        lines = [
            f"[{record['index'] + 1}/{self.total}] {record['question_id']}  gold {gold}",
            f"    {_short(question, 110)}",
            f"    zero-shot {_shown(rows['zero_shot'], gold)}  {_tokens(tokens.get('zero_shot'))}",
            f"    self-cons.{_shown(rows['self_consistency'], gold)}  {_tokens(tokens.get('self_consistency'))}"
            f"  votes {shown}",
            f"    memory    {_shown(rows['stream_greedy'], gold)}  {_tokens(tokens.get('stream_greedy'))}"
            f"  (the stream memory's greedy answer, version {turn.get('version')})",
            f"    ELM       {_shown(rows['elm_amortized'], gold)}  {_tokens(tokens.get('elm_amortized'))}"
            f"  mode {mode}: {MODES.get(mode, 'unknown')}",
        ]
        update = a.get("update") or {}
        gate = f"gate {turn.get('gate')}" + (", a probe" if turn.get("probe") else "")
        if (reading := update.get("gate")) is not None:
            outcome = reading.get("outcome")
            gate += f"; its reading: {outcome} ({OUTCOMES.get(outcome, outcome)})"
        elif update.get("skipped") == "not_probed":
            gate += "; not a probe: no reading"
        lines.append("              " + gate)
        if decision := update.get("gate_decision"):
            lines.append("              gate decision: " + _decision(decision))
        t = record.get("timings") or {}
        lines.append(f"              answer {t.get('answer', 0):.0f}s, learn {t.get('learn', 0):.0f}s")
        return "\n".join(lines)


def summary_table(
    summary: Mapping[str, Mapping[str, Any]], records: Sequence[Mapping[str, Any]], config: Mapping[str, Any]
) -> str:
    """``elm demo``'s one closing table: each method's accuracy, and before each ELM method the paired rows read
    from its own records (self-consistency on its samples, ELM with the memory untrained)."""
    paired = {p["method"]: p for p in paired_summaries([list(records)], list(summary), config)}
    lines = ["| method | what it is | right | of | accuracy (%) |", "|---|---|---:|---:|---:|"]
    for method, s in summary.items():
        p = paired.get(method)
        for variant in ("self_consistency", "elm_untrained") if p else ():
            a = p["accuracy"].get(variant) if p else None
            if a and a["judged"]:
                meaning = f"{MEANINGS[variant]}, read from {method}'s records"
                right, judged = a["right"], a["judged"]
                lines.append(f"| {variant} | {meaning} | {right} | {judged} | {_pct(right, judged)} |")
        what = "the greedy answer" if method == "zero_shot" else ("ELM" if method.startswith("elm_") else "")
        lines.append(f"| {method} | {what} | {s['correct']} | {s['n']} | {_pct(s['correct'], s['n'])} |")
    return "\n".join(lines) + "\n"


def amortized_summary(records: Sequence[Mapping[str, Any]], *, min_questions: int = 16) -> str:
    """``elm demo --amortized``'s one closing table (accuracy and tokens per question of zero-shot, self-consistency,
    the memory's greedy answer and ELM amortized over every question), the modes and what the gate did."""
    from elm_memory.eval.amortized_report import amortized_records, summarize_amortized

    mine = amortized_records(records)
    if not mine:
        return ""
    part = summarize_amortized([mine], [0])["parts"]["all"]
    lines = [
        f"Over all {part['answers']} questions:",
        "",
        "| method | accuracy (%) | tokens / question |",
        "|---|---:|---:|",
    ]
    for row in ("zero_shot", "self_consistency", "stream_greedy", "elm_amortized"):
        acc, tok = part["accuracy"][row], part["tokens"][row]
        shown = ("-" if acc is None else f"{100 * acc:.1f}", "-" if tok is None else f"{tok:.0f}")
        lines.append(f"| {row} | {shown[0]} | {shown[1]} |")
    modes = ", ".join(f"{m} {n}" for m, n in part["modes"].items())
    lines += ["", f"ELM amortized's modes: {modes}."]
    outcomes = [((r["extra"]["amortized"].get("update") or {}).get("gate") or {}).get("outcome") for r in mine]
    read = [o for o in outcomes if o is not None]
    decisions = [
        (r["index"], d) for r in mine if (d := (r["extra"]["amortized"].get("update") or {}).get("gate_decision"))
    ]
    tally = (
        f"{len(read)} probed question(s) read: {read.count('win')} won by the memory, {read.count('loss')} by zero-shot"
    )
    if decisions:
        lines.append(f"The gate's decisions ({tally}):")
        lines += [f"- question {i + 1}: {_decision(d)}" for i, d in decisions]
    else:
        state = mine[-1]["extra"]["amortized"].get("gate_after") or mine[-1]["extra"]["amortized"]["turn"]["gate"]
        lines.append(
            f"The gate stayed in {state} ({tally}): it opens only after at least {min_questions} probed questions "
            "and a clear lead of the memory over zero-shot, so on a short stream the vote answers every question "
            "and ELM spends self-consistency's tokens plus the memory's row; the tokens fall only on longer streams."
        )
    return "\n".join(lines) + "\n"


def _decision(d: Mapping[str, Any]) -> str:
    return (
        f"{d.get('previous')} -> {d.get('state')} ({d.get('reason')}; {d.get('wins')} wins, {d.get('losses')} "
        f"losses over {d.get('readings')} probes)"
    )


def _tokens(n: int | None) -> str:
    return f"{'-' if n is None else n:>5} tokens"


def _pct(right: int, n: int) -> str:
    return f"{100 * right / n:.1f}" if n else "-"


def _shown(answer: str | None, gold: str) -> str:
    text = "(none)" if answer is None else _short(str(answer), 10)
    return f"{text:>10} {MARK[bool(equivalent(answer, gold))]}"


def elm_answer(record: dict[str, Any]) -> str:
    answer = record.get("answer")
    return "(none)" if answer is None else _short(str(answer), 10)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
