"""Reading ``elm_amortized`` records: accuracy and tokens per question of every row, the planned sign tests, the
gate's decisions, and how often the labels the memory learned from were right at each vote-share threshold.

Every number is recomputed from the records (``extra.amortized``): each row's answer and tokens per question, the
turn's mode and gate state, the samples' answers (so a label and its vote share are recounted, not trusted).
The test part of a run is its second half (the first half, the smaller when odd, is its warm-up), as planned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.eval.significance import sign_test

ROWS = ("zero_shot", "self_consistency", "stream_greedy", "init_greedy", "elm_amortized")
#: (row, baseline): the planned readings, each an exact two-sided sign test over distinct questions.
PLANNED = (
    ("elm_amortized", "zero_shot"),
    ("elm_amortized", "self_consistency"),
    ("stream_greedy", "zero_shot"),
    ("stream_greedy", "init_greedy"),
)
THRESHOLDS = (0.4, 0.6, 0.8, 1.0)


def amortized_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that carry amortized rows, in stream order."""
    mine = [r for r in records if ((r.get("extra") or {}).get("amortized") or {}).get("rows")]
    return sorted(mine, key=lambda r: r["index"])


def warmup_of(records: Sequence[Mapping[str, Any]]) -> int:
    """The first half of the questions a run answered (the smaller half when odd)."""
    return len({r["question_id"] for r in amortized_records(records)}) // 2


def summarize_amortized(runs: Sequence[Sequence[Mapping[str, Any]]], warmups: Sequence[int]) -> dict[str, Any]:
    """Pooled over ``runs`` (each a run's records): per part (``test``: index >= the run's warm-up; ``all``) every
    row's accuracy and mean tokens per question, the planned sign tests, the share of self-consistency's gain and
    tokens ELM amortized has, the gate's extra tokens and the turns' modes; the labels' quality per threshold; the
    gate's decisions."""
    mine = [amortized_records(r) for r in runs]
    out: dict[str, Any] = {"runs": len(runs), "warmup": list(warmups), "parts": {}}
    for part in ("test", "all"):
        chosen = [[r for r in run if part == "all" or r["index"] >= w] for run, w in zip(mine, warmups, strict=True)]
        flat = [r for run in chosen for r in run]
        n = len(flat)
        accuracy = {row: _mean([row_right(r, row) for r in flat]) for row in ROWS}
        tokens = {row: mean_row_tokens(flat, row) for row in ROWS}
        tests = []
        for row, base in PLANNED:
            wins, losses = _signs(chosen, row, base)
            tests.append({"row": row, "baseline": base, "wins": wins, "losses": losses, "p": sign_test(wins, losses)})
        zs, sc, elm = accuracy["zero_shot"], accuracy["self_consistency"], accuracy["elm_amortized"]
        spent = sum(_tokens(r, "elm_amortized") or 0 for r in flat)
        modes: dict[str, int] = {}
        for r in flat:
            mode = r["extra"]["amortized"]["turn"]["mode"]
            modes[mode] = modes.get(mode, 0) + 1
        out["parts"][part] = {
            "answers": n,
            "accuracy": accuracy,
            "tokens": tokens,
            "tests": tests,
            "gain_recovered": (elm - zs) / (sc - zs) if None not in (zs, sc, elm) and sc > zs else None,  # type: ignore[operator]
            "token_share": tokens["elm_amortized"] / tokens["self_consistency"]
            if tokens["elm_amortized"] is not None and tokens["self_consistency"]
            else None,
            "gate_extra_share": sum(r["extra"]["amortized"]["gate_extra_tokens"] for r in flat) / spent
            if spent
            else None,
            "modes": modes,
        }
    out["labels"] = label_quality([r for run in mine for r in run])
    out["decisions"] = [
        {"run": i, "index": r["index"], **r["extra"]["amortized"]["update"]["gate_decision"]}
        for i, run in enumerate(mine)
        for r in run
        if (r["extra"]["amortized"].get("update") or {}).get("gate_decision")
    ]
    return out


def label_quality(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per vote-share threshold: how many questions' votes (zero-shot's greedy answer and the samples) are that
    clear, and how often their label is the gold answer. Dev streams only: the gold answer is read here, never by
    the method."""
    out = []
    for t in THRESHOLDS:
        kept = [r for r in records if r["extra"]["amortized"]["vote_share"] >= t - 1e-9 and _label(r) is not None]
        right = sum(bool(equivalent(_label(r), r["gold"])) for r in kept)
        out.append(
            {"threshold": t, "kept": len(kept), "of": len(records), "right": right, "precision": _ratio(right, kept)}
        )
    return out


def markdown_amortized(summary: Mapping[str, Any]) -> str:
    """The amortized rows' table (test part and all), the planned tests, and the labels' quality."""
    lines = ["", "Amortized stream memory (rows from the same decode calls; test = each run's second half):", ""]
    lines += [
        "| row | test accuracy | test tokens / question | all accuracy | all tokens / question |",
        "|---|---:|---:|---:|---:|",
    ]
    test, every = summary["parts"]["test"], summary["parts"]["all"]
    for row in ROWS:
        lines.append(
            f"| {row} | {_pct(test['accuracy'][row])} | {_num(test['tokens'][row])} | {_pct(every['accuracy'][row])} "
            f"| {_num(every['tokens'][row])} |"
        )
    lines += ["", f"Test part: {test['answers']} answers; modes {test['modes']}.", ""]
    lines += ["| reading (test) | wins | losses | p |", "|---|---:|---:|---:|"]
    lines += [f"| {t['row']} vs {t['baseline']} | {t['wins']} | {t['losses']} | {t['p']:.3g} |" for t in test["tests"]]
    lines += [
        "",
        f"Test part: ELM amortized spends {_pct(test['token_share'])} of self-consistency's tokens and recovers "
        f"{_pct(test['gain_recovered'])} of its gain over zero-shot; the gate's own rows are "
        f"{_pct(test['gate_extra_share'])} of its tokens.",
        "",
        "| labels: vote share at least | questions kept | labels right |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {x['threshold']:.1f} | {x['kept']} of {x['of']} | {_pct(x['precision'])} |" for x in summary["labels"]
    ]
    if summary["decisions"]:
        lines += ["", "Gate decisions:", ""]
        lines += [
            f"- run {d['run']}, question {d['index']}: {d['previous']} -> {d['state']} ({d['reason']}; "
            f"{d['wins']} wins, {d['losses']} losses over {d['readings']} probes)"
            for d in summary["decisions"]
        ]
    else:
        lines += ["", "The gate made no decision: every question was answered by the vote."]
    return "\n".join(lines) + "\n"


def plot_amortized(records: Sequence[Mapping[str, Any]], out_dir: str | Path, *, warmup: int) -> Path | None:
    """``amortized.png``: left, every row's test-part accuracy against its tokens per question (a point each) and
    ELM amortized's path over the stream (blocks of questions); right, ELM's tokens per question over the stream
    with the gate's state, beside self-consistency's."""
    from elm_memory.eval.report import _figure, _save

    mine = amortized_records(records)
    if not mine:
        return None
    fig = _figure(11.0, 4.5)
    left, right = fig.subplots(1, 2)
    test = [r for r in mine if r["index"] >= warmup] or mine
    init_is_zero_shot = all(r["extra"]["amortized"].get("init_is_zero_shot") for r in test)
    for row in ROWS:
        acc, tok = _mean([row_right(r, row) for r in test]), mean_row_tokens(test, row)
        if acc is None or tok is None:
            continue
        if row == "init_greedy" and init_is_zero_shot:  # a LoRA's init is zero-shot: a ring, not a hidden point
            left.plot([tok], [acc], "o", markersize=13, fillstyle="none", label=f"{row} (= zero-shot)")
        else:
            left.plot([tok], [acc], "o", markersize=8, label=row)
    block = max(5, len(mine) // 8)
    xs, ys = [], []
    for start in range(0, len(mine), block):
        part = mine[start : start + block]
        xs.append(mean_row_tokens(part, "elm_amortized"))
        ys.append(_mean([row_right(r, "elm_amortized") for r in part]))
    left.plot(xs, ys, "-", color="grey", linewidth=0.8, label=f"elm_amortized, blocks of {block} (in order)")
    left.set_xlabel("tokens generated per question")
    left.set_ylabel("accuracy")
    left.set_title("Accuracy against tokens (test part)")
    left.legend(fontsize=7, loc="best")
    idx = [r["index"] + 1 for r in mine]
    right.plot(
        idx, [_tokens(r, "self_consistency") for r in mine], linestyle="--", linewidth=0.8, label="self-consistency"
    )
    right.plot(idx, [_tokens(r, "elm_amortized") for r in mine], linewidth=1.0, label="ELM amortized")
    serving = [r["index"] + 1 for r in mine if r["extra"]["amortized"]["turn"]["gate"] == "serving"]
    if serving:
        right.plot(serving, [0] * len(serving), "|", color="green", markersize=8, label="gate open")
    right.axvline(warmup + 0.5, color="grey", linewidth=0.8, linestyle=":")
    right.set_xlabel("question (dotted: end of warm-up)")
    right.set_ylabel("tokens generated")
    right.set_title("Tokens per question")
    right.legend(fontsize=7, loc="best")
    return _save(fig, Path(out_dir), "amortized.png")


def _label(r: Mapping[str, Any]) -> str | None:
    return r["extra"]["amortized"]["rows"]["self_consistency"]


def row_right(r: Mapping[str, Any], row: str) -> float:
    """1.0 when the record's ``row`` answer is the gold answer (the verifier's equivalence), else 0.0."""
    return float(bool(equivalent(r["extra"]["amortized"]["rows"].get(row), r["gold"])))


def mean_row_tokens(records: Sequence[Mapping[str, Any]], row: str) -> float | None:
    """Mean tokens per question of ``row`` over the records that counted it (None where none did)."""
    return _mean([_tokens(r, row) for r in records])


def _tokens(r: Mapping[str, Any], row: str) -> float | None:
    tokens = r["extra"]["amortized"]["tokens"]
    if row == "init_greedy" and row not in tokens and r["extra"]["amortized"].get("init_is_zero_shot"):
        row = "zero_shot"  # a LoRA's untrained memory is the base model: its row is zero-shot's
    value = tokens.get(row)
    return float(value) if value is not None else None


def _signs(runs: Sequence[Sequence[Mapping[str, Any]]], row: str, base: str) -> tuple[int, int]:
    net: dict[str, float] = {}
    for run in runs:
        for r in run:
            net[r["question_id"]] = net.get(r["question_id"], 0.0) + row_right(r, row) - row_right(r, base)
    return sum(v > 0 for v in net.values()), sum(v < 0 for v in net.values())


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _ratio(right: int, kept: Sequence[Any]) -> float | None:
    return right / len(kept) if kept else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
