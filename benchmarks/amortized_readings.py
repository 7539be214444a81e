"""Issue #65: the readings of a finished ``elm_amortized`` run that ``elm report`` does not print, recounted from its
records (no decode): the turns' modes, when the gate changed state, the updates and rollbacks, the gate's readings,
the serving probes, and self-consistency's lead over zero-shot per half. The readouts' ``readings.txt``.

    python -m benchmarks.amortized_readings benchmarks/results/amortized_evidence/synth-arith_89
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elm_memory.eval.amortized_report import amortized_records, row_right
from elm_memory.eval.records import RecordLog


def _count(records: Sequence[Mapping[str, Any]], row: str) -> int:
    return int(sum(row_right(r, row) for r in records))


def readings(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The lines of ``readings.txt`` for one run's ``elm_amortized`` records, in stream order."""
    extras = [r["extra"]["amortized"] for r in records]
    half = len(records) // 2
    modes = Counter(e["turn"]["mode"] for e in extras)
    test_modes = Counter(e["turn"]["mode"] for e in extras[half:])
    out = [f"questions {len(records)} modes {dict(modes)} test modes {dict(test_modes)}"]
    states = [(r["index"] + 1, e.get("gate_after")) for r, e in zip(records, extras, strict=True)]
    changes = [(q, s) for i, (q, s) in enumerate(states) if i == 0 or s != states[i - 1][1]]
    out.append(f"gate states (question, state after): {changes}")
    updates = [e.get("update") or {} for e in extras]
    skipped = Counter(u.get("skipped") for u in updates if not u.get("applied"))
    out.append(f"updates applied {sum(bool(u.get('applied')) for u in updates)} skipped {skipped}")
    rollbacks = [
        (r["index"] + 1, u["guard"]["reasons"], u["guard"]["rollback_to"])
        for r, u in zip(records, updates, strict=True)
        if (u.get("guard") or {}).get("reasons")
    ]
    out.append(f"rollbacks {rollbacks}")
    decisions = [
        (r["index"] + 1, u["gate_decision"]) for r, u in zip(records, updates, strict=True) if u.get("gate_decision")
    ]
    out.append(f"gate decisions {decisions}")
    out.append(f"gate outcomes {dict(Counter((u.get('gate') or {}).get('outcome') for u in updates))}")
    serving = [r for r, e in zip(records, extras, strict=True) if e["turn"]["mode"] != "self_consistency"]
    probes = [r for r in serving if r["extra"]["amortized"]["turn"].get("probe")]
    if serving:
        out.append(f"serving questions {len(serving)} probes {len(probes)}")
        for row in ("stream_greedy", "zero_shot", "self_consistency"):
            out.append(f" probe {row} {_count(probes, row)} / {len(probes)}")
    for part, chosen in (("test", records[half:]), ("all", records)):
        zero, vote = _count(chosen, "zero_shot"), _count(chosen, "self_consistency")
        lead = round(100 * (vote - zero) / len(chosen), 1)
        out.append(f"{part} ZS {zero} SC {vote} of {len(chosen)} SC-ZS points {lead}")
    return out


def load(run: Path) -> list[Mapping[str, Any]]:
    """A run directory's ``elm_amortized`` records, in stream order."""
    return amortized_records(RecordLog(run / "records.jsonl").read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an elm_amortized run directory (records.jsonl)")
    args = ap.parse_args()
    print("\n".join(readings(load(args.run))))


if __name__ == "__main__":
    main()
