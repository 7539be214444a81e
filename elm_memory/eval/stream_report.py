"""Reading a stream-memory run (``elm_stream`` records): every row's accuracy on the test half and on the whole
stream, the planned sign tests, the memory's versions, updates and rollbacks, and the accuracy-over-stream plot.

Every row is read from the records' ``extra.stream.rows`` (one decode call per question made them all), and
graded here against the record's gold answer, so the tables can be recounted from ``records.jsonl`` alone.
Pooling several runs (seeds): a question counts once in a sign test (:func:`~elm_memory.eval.significance
.paired_outcomes`'s rule: the sign of right-minus-right over the runs where both rows answered it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.significance import sign_test

#: The planned comparisons: (row, baseline) with the row's arm filled in.
PLANNED = (
    ("stream_greedy[{arm}]", "zero_shot"),
    ("stream_vote[{arm}]", "self_consistency"),
    ("stream_greedy[{arm}]", "init_greedy"),
    ("stream_greedy[{arm}]", "format"),
    ("stream_zs_vote[{arm}]", "self_consistency"),  # stream.tuning.learn_from: zero_shot only
)


def stream_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that carry stream rows, in stream order."""
    mine = [r for r in records if ((r.get("extra") or {}).get("stream") or {}).get("rows")]
    return sorted(mine, key=lambda r: (r["method"], r["index"]))


def warmup_of(records: Sequence[Mapping[str, Any]]) -> int:
    """The planned warm-up: the first half of the questions a run answered (the smaller half when odd); the
    rest is its test part."""
    return len({r["question_id"] for r in stream_records(records)}) // 2


def arms_of(records: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = records[0]["extra"]["stream"]["rows"] if records else {}
    return [name[len("stream_vote[") : -1] for name in rows if name.startswith("stream_vote[")]


def graded(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per record: question id, index, and for every row whether its answer equals the gold answer and whether it
    has none (no ``\\boxed{}`` answer: the format failures training may repair)."""
    return [
        {
            "question_id": r["question_id"],
            "index": r["index"],
            "right": {row: bool(equivalent(a, r["gold"])) for row, a in r["extra"]["stream"]["rows"].items()},
            "unboxed": {row: a is None for row, a in r["extra"]["stream"]["rows"].items()},
        }
        for r in records
    ]


def summarize_stream(runs: Sequence[Sequence[Mapping[str, Any]]], *, warmup: int | Sequence[int]) -> dict[str, Any]:
    """Rows' accuracy on the test part (index >= ``warmup``) and on all, and the planned sign tests on the test
    part, pooled over ``runs`` (each a run's records). ``warmup``: one for every run, or one per run (seeds
    stopped at different counts each keep their own second half)."""
    warmups = [warmup] * len(runs) if isinstance(warmup, int) else list(warmup)
    if len(warmups) != len(runs):
        raise ValueError(f"{len(warmups)} warm-up lengths for {len(runs)} runs")
    per_run = [graded(stream_records(r)) for r in runs]
    arms = arms_of(stream_records(runs[0])) if runs else []
    rows = list(per_run[0][0]["right"]) if per_run and per_run[0] else []
    out: dict[str, Any] = {"warmup": warmup if isinstance(warmup, int) else warmups, "arms": arms, "runs": len(runs)}
    out["parts"] = {}
    for part in ("test", "all"):
        chosen = [[g for g in run if part == "all" or g["index"] >= w] for run, w in zip(per_run, warmups, strict=True)]
        n = sum(len(c) for c in chosen)
        accuracy = {row: (sum(g["right"][row] for c in chosen for g in c) / n if n else None) for row in rows}
        unboxed = {row: (sum(g["unboxed"][row] for c in chosen for g in c) / n if n else None) for row in rows}
        tests = []
        for arm in arms:
            for row_t, base in PLANNED:
                row = row_t.format(arm=arm)
                if row not in rows:
                    continue
                wins, losses = _signs(chosen, row, base)
                tests.append(
                    {"row": row, "baseline": base, "wins": wins, "losses": losses, "p": sign_test(wins, losses)}
                )
        out["parts"][part] = {"answers": n, "accuracy": accuracy, "unboxed": unboxed, "tests": tests}
    return out


def _signs(runs: Sequence[Sequence[Mapping[str, Any]]], row: str, base: str) -> tuple[int, int]:
    net: dict[str, int] = {}
    for run in runs:
        for g in run:
            net[g["question_id"]] = net.get(g["question_id"], 0) + int(g["right"][row]) - int(g["right"][base])
    return sum(v > 0 for v in net.values()), sum(v < 0 for v in net.values())


def stream_history(records: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per arm, per question: the version used, whether it updated, why not, and any guard verdict."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in stream_records(records):
        for arm, u in (r["extra"]["stream"].get("updates") or {}).items():
            out.setdefault(arm, []).append(
                {
                    "index": r["index"],
                    "version_used": u.get("version_used"),
                    "version": u.get("version"),
                    "applied": u.get("applied"),
                    "skipped": u.get("skipped"),
                    "moved": u.get("moved"),
                    "guard": u.get("guard"),
                    "seconds": u.get("seconds"),
                }
            )
    return out


def markdown_stream(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown: one accuracy table (test part and all), one table of the planned tests."""
    parts = summary["parts"]
    test, whole = parts["test"], parts["all"]
    lines = [
        f"Stream memory rows ({summary['runs']} run(s); test = questions after the first {_warmups(summary)}):",
        "",
        f"| row | test ({test['answers']}) | all ({whole['answers']}) | no answer, test | no answer, all |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row, acc in test["accuracy"].items():
        lines.append(
            f"| {row} | {_pct(acc)} | {_pct(whole['accuracy'][row])} | {_pct(test['unboxed'][row])} "
            f"| {_pct(whole['unboxed'][row])} |"
        )
    lines += ["", "Planned tests on the test part (exact two-sided sign test over distinct questions):", ""]
    lines += ["| row | against | wins | losses | p |", "| --- | --- | ---: | ---: | ---: |"]
    for t in test["tests"]:
        lines.append(f"| {t['row']} | {t['baseline']} | {t['wins']} | {t['losses']} | {t['p']:.3g} |")
    return "\n".join(lines) + "\n"


def _warmups(summary: Mapping[str, Any]) -> str:
    w = summary["warmup"]
    return str(w) if isinstance(w, int) else ", ".join(map(str, w)) + " of each run"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def plot_stream(records: Sequence[Mapping[str, Any]], out_dir: str | Path, *, warmup: int) -> Path | None:
    """Cumulative accuracy of every row over the stream, the warm-up's end marked, each arm's rollbacks
    marked on its curves; ``stream_accuracy.png``."""
    from elm_memory.eval.report import _figure, _save

    mine = stream_records(records)
    if not mine:
        return None
    grades = graded(mine)
    fig = _figure(8.0, 5.0)
    ax = fig.subplots()
    xs = [g["index"] + 1 for g in grades]
    history = stream_history(mine)
    # a LoRA stream memory's init is the base model: its curve would hide zero-shot's, so one curve names both
    init_is_zero_shot = all(r["extra"]["stream"].get("init_is_zero_shot") for r in mine)
    for row in grades[0]["right"]:
        if init_is_zero_shot and row == "init_greedy":
            continue
        right, ys = 0, []
        for i, g in enumerate(grades, 1):
            right += g["right"][row]
            ys.append(right / i)
        dashed = row in ("zero_shot", "self_consistency")
        label = "zero_shot (= init_greedy)" if init_is_zero_shot and row == "zero_shot" else row
        line = ax.plot(xs, ys, label=label, linestyle="--" if dashed else "-", linewidth=1.2)[0]
        arm = row[row.find("[") + 1 : -1] if "[" in row else None
        if arm is not None:
            marks = [h["index"] + 1 for h in history.get(arm, []) if h["skipped"] == "rolled_back"]
            ax.plot(
                marks, [ys[xs.index(m)] for m in marks], "x", color=line.get_color(), markersize=10, mew=2.5, zorder=5
            )
    ax.axvline(warmup + 0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("question (x: a rollback; dotted: end of warm-up)")
    ax.set_ylabel("accuracy so far")
    ax.set_title("Stream memory against its controls, same questions")
    ax.legend(fontsize=7, loc="best")
    return _save(fig, Path(out_dir), "stream_accuracy.png")
