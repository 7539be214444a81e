"""Reporting for the evaluation harness: Markdown tables and PNG figures.

Inputs are the summaries of :mod:`elm_memory.eval.metrics` and the raw online records. matplotlib
is imported only inside the plotting functions (importing this module stays cheap), and figures
are drawn with the object-oriented ``Figure`` API on the Agg canvas, so plotting works on a
headless machine and never touches pyplot's global state.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from elm_memory.eval.metrics import Record, ordered_records, route_counts, running_accuracy

__all__ = [
    "markdown_ablations",
    "markdown_full_model",
    "markdown_offline",
    "markdown_online",
    "plot_offline",
    "plot_online",
]

# Routes the runner is known to emit, in the order a reader expects; others follow alphabetically.
_ROUTE_ORDER = ("zero_shot", "context", "agree", "answered", "verifier", "vote")
_DPI = 120


# --- formatting helpers -------------------------------------------------------------------------


def _cell(value: Any) -> str:
    """A table cell; pipes would split the cell, so they are escaped."""
    return str(value).replace("|", "\\|")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], right_from: int = 1) -> str:
    """A GitHub Markdown table; numeric columns (from ``right_from``) are right-aligned."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _route_columns(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    seen = {route for stats in summary.values() for route in stats.get("routes", {})}
    known = [r for r in _ROUTE_ORDER if r in seen]
    return known + sorted(seen - set(known))


# --- Markdown -----------------------------------------------------------------------------------


def markdown_online(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """The online results table (one row per method, in the summary's order), like the paper's.

    Route columns hold how many questions each route decided; pool MB is decimal (10^6 bytes).
    """
    if not summary:
        raise ValueError("markdown_online needs a summary with at least one method")
    routes = _route_columns(summary)
    header = [
        "method",
        "n",
        "accuracy (%)",
        "its zero-shot (%)",
        "gains/losses",
        *routes,
        "answer s/q",
        "learn s/q",
        "pool size",
        "pool MB",
    ]
    rows = []
    for method, s in summary.items():
        counts = s.get("routes", {})
        rows.append(
            [
                _cell(method),
                str(s["n"]),
                _pct(s["accuracy"]),
                _pct(s.get("zero_shot_candidate_accuracy")),
                "n/a" if s.get("gains") is None else f"+{s['gains']}/-{s['losses']}",
                *(str(counts.get(route, 0)) for route in routes),
                _num(s["answer_seconds_mean"], 1),
                _num(s["learn_seconds_mean"], 1),
                str(s["pool_size"]),
                _num(s["pool_bytes"] / 1e6, 2),
            ]
        )
    return _table(header, rows)


def markdown_offline(summary: Mapping[str, Any]) -> str:
    """The offline study as a two-column table: does one memory help the whole benchmark?"""
    best = summary.get("best_memory")
    best_text = "n/a" if best is None else f"{_pct(best['accuracy'])} ({_cell(best['id'])})"
    top = summary.get("top_flip", 5)
    rows = [
        ["zero-shot accuracy (%)", _pct(summary["zero_shot_accuracy"])],
        ["best memory accuracy (%)", best_text],
        ["best memory picked on half the questions, vs zero-shot on the other half (points)", _held_out(summary)],
        ["mean memory accuracy (%)", _pct(summary["mean_memory_accuracy"])],
        ["oracle ZS vs Mem accuracy (%)", _pct(summary["oracle_accuracy"])],
        ["memories improving on zero-shot (%)", _pct(summary["fraction_improving"])],
        [f"mean negative flip rate, top-{top} (%)", _pct(summary["mean_negative_flip_rate"])],
        ["IoU of improved questions, top-2", _num(summary["iou_top2"], 3)],
    ]
    title = f"{summary.get('n_questions', '?')} questions, {summary.get('n_memories', '?')} memories"
    return _table([f"metric ({title})", "value"], rows)


def _held_out(summary: Mapping[str, Any]) -> str:
    held = summary.get("best_memory_held_out")
    if held is None:
        return "n/a"
    return (
        f"{100 * held['mean_gain']:+.1f} (better on {100 * held['share_better']:.0f}%, worse on "
        f"{100 * held['share_worse']:.0f}% of {held['splits']} splits)"
    )


def markdown_full_model(summary: Mapping[str, Any]) -> str:
    """The full-model baseline (``elm offline --full-model``) next to zero-shot, as a two-column table."""
    method = summary["method"]
    settings = summary.get("settings") or {}
    gains = summary.get("gains")
    first, last = summary.get("mean_reward_first_step"), summary.get("mean_reward_last_step")
    rows = [
        ["zero-shot accuracy (%)", _pct(summary["zero_shot_accuracy"])],
        [f"{method} full-model accuracy (%)", _pct(summary["full_model_accuracy"])],
        [f"oracle ZS vs {method} accuracy (%)", _pct(summary["oracle_accuracy"])],
        ["gains/losses vs zero-shot", "n/a" if gains is None else f"+{gains}/-{summary['losses']}"],
        ["negative flip rate (%)", _pct(summary["negative_flip_rate"])],
        ["optimizer steps (questions each)", f"{summary.get('optimizer_steps')} ({summary.get('questions_per_step')})"],
        ["mean reward, first -> last step", f"{_num(first, 3)} -> {_num(last, 3)}"],
        ["training seconds", _num(summary.get("training_seconds"), 1)],
    ]
    title = (
        f"{summary.get('n_questions', '?')} questions, {method} on {summary.get('n_trained', '?')}, "
        f"{settings.get('epochs', '?')} epoch(s), lr {settings.get('learning_rate', '?')}"
    )
    return _table([f"metric ({title})", "value"], rows)


def markdown_ablations(rows: Sequence[Mapping[str, Any]], not_expressible: Sequence[tuple[str, str]] = ()) -> str:
    """The ablation table (``elm offline --ablations``): one row per variant, the offline metrics as
    columns; then the paper's rows the run could not express, and why."""
    if not rows:
        raise ValueError("markdown_ablations needs at least one variant")
    top = rows[0].get("top_flip", 5)
    header = [
        "variant",
        "paper row",
        "overrides",
        "objective",
        "S",
        "zero-shot (%)",
        "best memory (%)",
        "mean memory (%)",
        "oracle ZS vs Mem (%)",
        "memories improving (%)",
        f"neg. flip top-{top} (%)",
        "IoU top-2",
        "learn s/memory",
    ]
    body = [
        [
            _cell(r["variant"]),
            _cell(r["paper_row"]),
            _cell(", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "-"),
            _cell(r["objective"]),
            str(r["steps"]),
            _pct(r["zero_shot_accuracy"]),
            _pct(r["best_memory_accuracy"]),
            _pct(r["mean_memory_accuracy"]),
            _pct(r["oracle_accuracy"]),
            _pct(r["fraction_improving"]),
            _pct(r["mean_negative_flip_rate"]),
            _num(r["iou_top2"], 3),
            _num(r["learn_seconds_mean"], 1),
        ]
        for r in rows
    ]
    n = rows[0].get("n_questions", "?")
    text = f"Ablations: {n} questions, one memory per question, each evaluated on all of them.\n\n"
    text += _table(header, body, right_from=3)
    if not_expressible:
        text += "\nNot expressible as a variant:\n\n" + "".join(f"- {row}: {why}\n" for row, why in not_expressible)
    return text


# --- figures ------------------------------------------------------------------------------------


def _figure(width: float = 7.0, height: float = 4.5) -> Any:
    """A pyplot-free figure: safe headless and inside notebooks (no global backend switch)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _integer_axis(axis: Any) -> None:
    """Counts, indices and ranks are whole numbers; default ticks would show 0.25 of a question."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _delta_bins(values: Sequence[float], max_bins: int = 40) -> list[float] | int:
    """Bin edges centred on the values: deltas are multiples of 1/n, so fixed-width bins would
    split or merge them arbitrarily. Falls back to ``max_bins`` equal bins when too spread out."""
    unique = sorted(set(values))
    if len(unique) == 1:
        return [unique[0] - 0.5, unique[0] + 0.5]
    width = min(b - a for a, b in pairwise(unique))
    count = round((unique[-1] - unique[0]) / width) + 1
    if count > max_bins:
        return max_bins
    start = unique[0] - width / 2
    return [start + i * width for i in range(count + 1)]


def _save(fig: Any, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def _by_method(records: Iterable[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(str(record.get("method")), []).append(record)
    return {method: ordered_records(rows) for method, rows in groups.items()}


def _plot_accuracy(groups: Mapping[str, list[Record]], out_dir: Path, paired: Mapping[str, Sequence[Record]]) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    for method, rows in groups.items():
        ax.plot([r["index"] for r in rows], [100 * a for a in running_accuracy(rows)], label=method, marker=".")
    for label, curve in paired.items():  # read from an ELM method's own records: dashed, no markers
        ordered = ordered_records(curve)
        ax.plot(
            [r["index"] for r in ordered], [100 * a for a in running_accuracy(ordered)], label=label, linestyle="--"
        )
    ax.set(title="Running accuracy over the question stream", xlabel="question index", ylabel="accuracy (%)")
    _integer_axis(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out_dir, "accuracy_over_stream.png")


def _plot_routes(groups: Mapping[str, list[Record]], out_dir: Path) -> Path:
    counts = {method: route_counts(rows) for method, rows in groups.items()}
    routes = _route_columns({m: {"routes": c} for m, c in counts.items()})
    fig = _figure()
    ax = fig.add_subplot()
    methods = list(counts)
    bottom = [0] * len(methods)
    for route in routes:
        heights = [counts[m].get(route, 0) for m in methods]
        ax.bar(methods, heights, bottom=bottom, label=route)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(title="Which route decided the answer", xlabel="method", ylabel="questions")
    _integer_axis(ax.yaxis)
    ax.legend(title="route")
    return _save(fig, out_dir, "routes.png")


def _plot_pool(groups: Mapping[str, list[Record]], out_dir: Path) -> Path | None:
    pooled = {m: rows for m, rows in groups.items() if any(r.get("pool_size") for r in rows)}
    if not pooled:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for method, rows in pooled.items():
        ax.plot([r["index"] for r in rows], [r.get("pool_size") or 0 for r in rows], label=method, marker=".")
    ax.set(title="Memory pool growth", xlabel="question index", ylabel="pool size (entries)")
    _integer_axis(ax.xaxis)
    _integer_axis(ax.yaxis)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out_dir, "pool_growth.png")


def plot_online(
    records: Iterable[Record], out_dir: str | os.PathLike[str], paired: Mapping[str, Sequence[Record]] | None = None
) -> list[Path]:
    """Stream accuracy, route mix and pool growth figures; ``pool_growth.png`` only if a pool grew.
    ``paired``: curves read from ELM's own records (:func:`elm_memory.eval.paired.paired_curves`), drawn
    dashed beside the methods' accuracy."""
    groups = _by_method(records)
    if not groups:
        raise ValueError("plot_online needs at least one record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_plot_accuracy(groups, out, paired or {}), _plot_routes(groups, out)]
    pool = _plot_pool(groups, out)
    return paths + ([pool] if pool is not None else [])


def plot_offline(summary: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Histogram of per-memory deltas vs zero-shot and the sorted per-memory accuracies.

    Returns no paths when the summary has no memories (there is nothing to draw).
    """
    memories = summary.get("memories") or []
    if not memories:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    zero_shot = 100 * summary["zero_shot_accuracy"]

    deltas = [100 * d for d in summary["deltas"]]
    fig = _figure()
    ax = fig.add_subplot()
    ax.hist(deltas, bins=_delta_bins(deltas), color="tab:blue", edgecolor="white")
    ax.axvline(0, color="black", linestyle="--", linewidth=1, label="zero-shot")
    improving = summary.get("fraction_improving")
    ax.set(
        title=f"Per-memory accuracy change vs zero-shot ({_pct(improving)}% of memories improve)",
        xlabel="accuracy delta (percentage points)",
        ylabel="memories",
    )
    _integer_axis(ax.yaxis)
    ax.legend()
    paths = [_save(fig, out, "memory_deltas.png")]

    ranked = sorted(memories, key=lambda m: (-m["accuracy"], m["id"]))
    fig = _figure(width=max(7.0, 0.15 * len(ranked)))
    ax = fig.add_subplot()
    ax.bar(range(1, len(ranked) + 1), [100 * m["accuracy"] for m in ranked], color="tab:green")
    ax.axhline(zero_shot, color="black", linestyle="--", linewidth=1, label=f"zero-shot ({zero_shot:.1f}%)")
    ax.set(title="Accuracy with each memory (sorted)", xlabel="memory rank", ylabel="accuracy (%)")
    _integer_axis(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.legend()
    paths.append(_save(fig, out, "memory_accuracy.png"))
    return paths
