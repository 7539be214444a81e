"""Issue #65: the evidence plan's targets, read from the pooled test halves of each stream's runs (no decode).

Each stream's runs are pooled by ``elm compare``'s own code (``compare_seeds``: test = each run's second half, the
exact sign test over distinct questions), then held against the targets that
``benchmarks/results/amortized_evidence/PLAN.md`` fixed before any run, and its rule for a third stream:

- at least one stream: ELM amortized at least 5 points above zero-shot with p < 0.05, at most 40% of
  self-consistency's tokens, recovering at least 60% of self-consistency's gain over zero-shot;
- every stream: ELM amortized not below zero-shot (wins >= losses over distinct questions);
- every stream: the gate's own extra decodes at most 10% of ELM amortized's tokens;
- third stream: planned when no stream's pooled self-consistency leads zero-shot by at least 8 points.

    python -m benchmarks.amortized_targets \\
        --stream synth-arith benchmarks/results/amortized_evidence/synth-arith_89 .../synth-arith_97 \\
        --stream gsm8k benchmarks/results/amortized_evidence/gsm8k_89 .../gsm8k_97
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elm_memory.errors import ConfigError
from elm_memory.eval.seeds import compare_seeds

GAIN_POINTS = 0.05  # ELM amortized over zero-shot, in accuracy
ALPHA = 0.05
TOKEN_SHARE = 0.40  # of self-consistency's tokens per question
GAIN_RECOVERED = 0.60  # of self-consistency's lead over zero-shot
GATE_SHARE = 0.10  # the gate's extra decodes, of ELM amortized's tokens
THIRD_STREAM_LEAD = 0.08  # self-consistency over zero-shot, below which a third stream is planned
PLOTTED = ("zero_shot", "self_consistency", "stream_greedy", "elm_amortized")
_EPS = 1e-9  # accuracies are ratios of counts: 0.05 may land a hair under itself


def stream_readings(runs: Sequence[str | Path]) -> dict[str, Any]:
    """One stream's pooled test-half readings, from its finished ``elm_amortized`` run directories."""
    comparison = compare_seeds(list(runs))
    if comparison.amortized is None:
        raise ConfigError(f"{', '.join(map(str, runs))}: not elm_amortized runs (no amortized rows in their records)")
    test = comparison.amortized["parts"]["test"]
    acc = test["accuracy"]
    [vs_zero] = [t for t in test["tests"] if (t["row"], t["baseline"]) == ("elm_amortized", "zero_shot")]
    return {
        "runs": [str(r) for r in runs],
        "seeds": [r.seed for r in comparison.runs],
        "answers": test["answers"],
        "zero_shot": acc["zero_shot"],
        "self_consistency": acc["self_consistency"],
        "elm_amortized": acc["elm_amortized"],
        "gain": acc["elm_amortized"] - acc["zero_shot"],
        "vote_lead": acc["self_consistency"] - acc["zero_shot"],
        "wins": vs_zero["wins"],
        "losses": vs_zero["losses"],
        "p": vs_zero["p"],
        "token_share": test["token_share"],
        "gain_recovered": test["gain_recovered"],
        "gate_extra_share": test["gate_extra_share"],
        "rows": {row: {"accuracy": acc[row], "tokens": test["tokens"][row]} for row in PLOTTED},
    }


def _first_target(s: Mapping[str, Any]) -> bool:
    return (
        s["gain"] >= GAIN_POINTS - _EPS
        and s["p"] < ALPHA
        and s["token_share"] is not None
        and s["token_share"] <= TOKEN_SHARE + _EPS
        and s["gain_recovered"] is not None
        and s["gain_recovered"] >= GAIN_RECOVERED - _EPS
    )


def verdict(streams: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each target per stream and overall (``any`` stream for the first, ``every`` stream for the others), and
    whether the plan's third stream is called for."""
    targets = [
        ("gain over zero-shot at a fraction of the vote's tokens", "any", _first_target),
        ("not below zero-shot", "every", lambda s: s["wins"] >= s["losses"]),
        (
            "gate at most 10% of the tokens",
            "every",
            lambda s: s["gate_extra_share"] is not None and s["gate_extra_share"] <= GATE_SHARE + _EPS,
        ),
    ]
    rows = []
    for name, scope, check in targets:
        per_stream = {stream: bool(check(s)) for stream, s in streams.items()}
        met = any(per_stream.values()) if scope == "any" else all(per_stream.values())
        rows.append({"target": name, "scope": scope, "streams": per_stream, "met": met})
    third = not any(s["vote_lead"] >= THIRD_STREAM_LEAD - _EPS for s in streams.values())
    return {"streams": dict(streams), "targets": rows, "third_stream_planned": third}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(result: Mapping[str, Any]) -> str:
    streams = result["streams"]
    lines = [
        "| stream (test halves pooled) | answers | zero-shot | self-consistency | ELM amortized "
        "| vs zero-shot (W/L, p) | tokens of the vote's | gain recovered | gate's share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in streams.items():
        lines.append(
            f"| {name} (seeds {', '.join(map(str, s['seeds']))}) | {s['answers']} | {_pct(s['zero_shot'])} "
            f"| {_pct(s['self_consistency'])} | {_pct(s['elm_amortized'])} | {s['wins']} / {s['losses']}, "
            f"p = {s['p']:.3g} | {_pct(s['token_share'])} | {_pct(s['gain_recovered'])} "
            f"| {_pct(s['gate_extra_share'])} |"
        )
    lines += ["", "| #65 target | where | " + " | ".join(streams) + " | met |"]
    lines.append("|---|---|" + "---|" * len(streams) + "---|")
    for t in result["targets"]:
        marks = " | ".join("yes" if t["streams"][n] else "no" for n in streams)
        where = "at least one stream" if t["scope"] == "any" else "every stream"
        lines.append(f"| {t['target']} | {where} | {marks} | {'**yes**' if t['met'] else '**no**'} |")
    leads = ", ".join(f"{n} {100 * s['vote_lead']:+.1f}" for n, s in streams.items())
    planned = "yes" if result["third_stream_planned"] else "no"
    lines += ["", f"Self-consistency's pooled lead over zero-shot (points): {leads}; third stream planned: {planned}."]
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Accuracy against tokens per question, one panel per stream, one point per row (pooled test halves)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display needed

    streams = result["streams"]
    points = [p for s in streams.values() for p in s["rows"].values() if None not in (p["accuracy"], p["tokens"])]
    low = min(100 * p["accuracy"] for p in points)
    high = max(100 * p["accuracy"] for p in points)
    fig = Figure(figsize=(5.0 * len(streams), 4.2), layout="constrained")
    for ax, (name, s) in zip(fig.subplots(1, len(streams), squeeze=False)[0], streams.items(), strict=True):
        labelled: list[tuple[float, float]] = []
        for row, point in s["rows"].items():
            if point["accuracy"] is None or point["tokens"] is None:
                continue
            acc, tokens = 100 * point["accuracy"], point["tokens"]
            ax.plot([tokens], [acc], "o", markersize=8, label=row)
            if not any(abs(tokens - t) < 80 and abs(acc - a) < 1 for t, a in labelled):  # once per cluster
                ax.annotate(f"{acc:.1f}", (tokens, acc), textcoords="offset points", xytext=(6, 4), fontsize=7)
                labelled.append((tokens, acc))
        ax.set_ylim(max(0.0, low - 5), min(100.0, high + 5))  # one scale for every stream: a gap reads the same
        ax.set_xlabel("tokens generated per question")
        ax.set_ylabel("accuracy (%)")
        seeds = ", ".join(map(str, s["seeds"]))
        ax.set_title(f"{name}, seeds {seeds}: test halves ({s['answers']} answers)", fontsize=9)
        ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--stream",
        nargs="+",
        action="append",
        required=True,
        metavar=("NAME", "RUN"),
        help="a stream's name, then its finished elm_amortized run directories (two seeds or more)",
    )
    ap.add_argument("--json", type=Path, help="also write the readings and the verdict here")
    ap.add_argument("--plot", type=Path, help="also draw accuracy against tokens per question here (.png)")
    args = ap.parse_args()
    streams = {}
    for name, *runs in args.stream:
        if name in streams:
            ap.error(f"stream {name} is given twice")
        try:
            streams[name] = stream_readings(runs)
        except ConfigError as exc:
            ap.error(f"stream {name}: {exc}")
    result = verdict(streams)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        plot(result, args.plot)
    print(markdown(result), end="")


if __name__ == "__main__":
    main()
