"""What ``elm memories`` prints: the list and stats tables, a memory's details, merge clusters, the check summary.

Plain functions from store records to text or JSON-ready dicts, kept apart from the
command wiring in :mod:`elm_memory.cli.memories` so the wording of a listing is in one place.
Every table starts with a header line, and shows memory ids by their first
:data:`~elm_memory.memory.ids.SHORT_ID_CHARS` characters (``--json`` prints them in full).
Imports neither torch nor chromadb.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from elm_memory.memory.ids import SHORT_ID_CHARS, short_id
from elm_memory.store.utility import shown_counters

if TYPE_CHECKING:
    from elm_memory.memory import LatentMemory
    from elm_memory.store.base import CheckReport, MemoryRecord
    from elm_memory.store.utility import Utility

#: ``elm memories stats --sort`` keys (highest first).
SORT_KEYS = ("won", "lost", "retrieved", "utility")
#: CheckReport lists, in the order the summary shows them.
_CHECK_FIELDS = (
    "reindexed",
    "orphan_rows",
    "superseded_blobs",
    "corrupt_blobs",
    "temp_files",
    "errors",
    "empty_collections",
    "pending_deletes",
    "orphan_blobs",
    "orphan_utility",
    "interrupted_merges",
)


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "never"


_ID = f"{'id':<{SHORT_ID_CHARS}}"
_LONG_HEX = re.compile(r"\b[0-9a-f]{32,64}\b")  # a memory id or a blob's sha256 in a check finding


def list_table(records: list[MemoryRecord]) -> list[str]:
    """``elm memories list``: a header and one line per memory."""
    lines = [f"{_ID}  {'namespace':<12} {'keys':<22} {'used':>4}  {'created':<19}  question"]
    for r in records:
        flag = "[no consensus] " if r.no_consensus else ""
        question = r.question.replace("\n", " ")
        lines.append(
            f"{short_id(r.id)}  {r.namespace[:12]:<12} {','.join(r.kinds)[:22]:<22} {r.usage:>4}  "
            f"{when(r.created_at):<19}  {flag}{question[:60]}"
        )
    return lines


def memory_view(record: MemoryRecord, memory: LatentMemory) -> dict[str, Any]:
    """``elm memories show --json``: record, metadata, soft-prompt (or lora/prefix weights) and key shapes."""
    if memory.kind == "soft_prompt":
        sp = memory.soft_prompt
        weights: dict[str, Any] = {
            "shape": list(sp.shape),
            "dtype": str(sp.dtype).removeprefix("torch."),
            "norm_mean": float(sp.norm(dim=1).mean()),
        }
    else:
        weights = {"kind": memory.kind, "tensors": len(memory.params), "parameters": memory.num_parameters}
    return {
        "record": record.to_dict(),
        "meta": asdict(memory.meta),
        "soft_prompt": weights,
        "keys": {k: {"dim": int(v.numel()), "norm": float(v.norm())} for k, v in memory.keys.items()},
    }


def memory_text(view: dict[str, Any]) -> str:
    """``elm memories show``: a :func:`memory_view` as aligned text."""
    m, r = view["meta"], view["record"]
    return (
        f"id:         {m['id']}\nnamespace:  {m['namespace']}\nmodel:      {m['model_name']} "
        f"(fingerprint {m['model_fingerprint']}, hidden {m['hidden_size']})\n"
        f"created:    {when(m['created_at'])}\nusage:      {r['usage']} (last {when(r['last_used_at'])})\n"
        f"blob:       {r['blob']}\nsoft prompt: {view['soft_prompt']}\nkeys:       {view['keys']}\n"
        f"stats:      steps={m['stats']['steps']} majority={m['stats']['majority_answer']!r} "
        f"share={m['stats']['majority_share']:.2f} no_consensus={m['stats']['no_consensus']}\n"
        f"question:   {m['question']}"
    )


def stats_row(r: MemoryRecord, u: Utility | None) -> dict[str, Any]:
    """One memory's record fields and utility counters (``elm memories stats --json``)."""
    return {
        "id": r.id,
        "namespace": r.namespace,
        "question": r.question,
        "created_at": r.created_at,
        "usage": r.usage,
        "last_used_at": r.last_used_at,
        **shown_counters(u),
    }


def sort_stats(rows: list[dict[str, Any]], sort: str, limit: int | None) -> list[dict[str, Any]]:
    """Highest ``sort`` first; a memory never judged (utility None) sorts last."""
    rows = sorted(rows, key=lambda x: (x[sort] is not None, x[sort] or 0, x["retrieved"]), reverse=True)
    return rows[:limit] if limit is not None else rows


def stats_table(rows: list[dict[str, Any]]) -> list[str]:
    """``elm memories stats``: a header and one line per :func:`stats_row`."""
    lines = [
        f"{_ID}  {'namespace':<12} {'used':>5} {'agree':>5} {'won':>5} {'lost':>5} {'util':>5} "
        f"{'sim':>5} {'gold':>7}  question"
    ]
    for x in rows:
        util = "-" if x["utility"] is None else f"{x['utility']:.2f}"
        sim = "-" if x["mean_similarity"] is None else f"{x['mean_similarity']:.2f}"
        gold = f"{x['gold_right']}/{x['gold_right'] + x['gold_wrong']}"
        question = x["question"].replace("\n", " ")
        lines.append(
            f"{short_id(x['id'])}  {x['namespace'][:12]:<12} {x['retrieved']:>5} {x['agreed']:>5} "
            f"{x['won']:>5} {x['lost']:>5} {util:>5} {sim:>5} {gold:>7}  {question[:50]}"
        )
    return lines


def merge_lines(cluster: dict[str, Any], questions: dict[str, str], merged_id: str | None) -> list[str]:
    """``elm memories merge``: one cluster (a :meth:`Cluster.to_dict`), its members and what it became."""
    into = f" -> {short_id(merged_id)}" if merged_id else ""
    lines = [
        f"{cluster['namespace']}: {len(cluster['ids'])} memories, {cluster['kind']} keys, "
        f"least similar pair {cluster['min_similarity']:.4f}{into}",
        f"  {_ID}  question",
    ]
    for mid in cluster["ids"]:
        lines.append(f"  {short_id(mid)}  {questions.get(mid, '').replace(chr(10), ' ')[:70]}")
    return lines


def check_summary(report: CheckReport, repair: bool) -> list[str]:
    """``elm memories check``: totals, each non-empty finding (first three items), the verdict."""
    lines = [f"{report.memories} memories, {report.blobs} blobs, {report.rows} index rows"]
    for name in _CHECK_FIELDS:
        items = getattr(report, name)
        if items:
            verb = "fixed" if repair else "found"
            lines.append(
                f"  {name.replace('_', ' ')}: {len(items)} {verb}  ({', '.join(_shorten(name, i) for i in items[:3])}"
                f"{', ...' if len(items) > 3 else ''})"
            )
    if report.ok:
        lines.append("ok")
    elif repair:
        lines.append("repair incomplete (see errors)" if report.errors else "repaired")
    else:
        lines.append("problems found; run with --repair")
    return lines


def _shorten(field: str, item: object) -> str:
    """A check finding with its ids (and blob hashes) shortened; temp file paths stay whole."""
    text = str(item)
    return text if field == "temp_files" else _LONG_HEX.sub(lambda m: short_id(m.group()), text)


def stream_lines(found: list[dict[str, Any]]) -> list[str]:
    """``elm memories streams``' table: a header, a row per stream memory, and under its row each gate
    decision with why, each time a resumed evaluation put the gate back, and what learning holds since its version."""
    lines = [
        f"{'namespace':<16} {'version':>7}  {'kind':<11} {'objective':<9} {'updates':>7}  {'kept':>9}  "
        f"{'gate':<10} {'rollbacks':<16}  path"
    ]
    for s in found:
        rollbacks = ", ".join(f"v{r['version']}->v{r['to']}" for r in s["rollbacks"]) or "none"
        kept = f"{s['versions_kept']}/{s['versions_written']}"
        gate = s.get("gate") or {}
        lines.append(
            f"{s['namespace']:<16} {s['version']:>7}  {s['kind']:<11} {s['objective']:<9} {s['updates']:>7}  "
            f"{kept:>9}  {gate.get('state') or 'off':<10} {rollbacks:<16}  {s['path']}"
        )
        for d in gate.get("decisions", []):
            lines.append(
                f"    gate {d['previous']} -> {d['state']}: {d['reason']} ({d['wins']} wins, {d['losses']} losses "
                f"in {d['readings']} readings; statistic {d['statistic']} >= {d['threshold']}; approved "
                f"v{d['approved_version']})"
            )
        for r in gate.get("restored", []):
            (was, now), (read, kept) = r["state"], r["readings"]
            lines.append(f"    gate put back: {was} -> {now}, {read} -> {kept} readings ({'; '.join(r['reasons'])})")
        held = s.get("pending") or {}
        if held.get("pooled") or held.get("guard_readings"):
            lines.append(
                f"    since v{s['version']}: {held['pooled']} of {held['update_every']} questions pooled for the next "
                f"update, {held['guard_readings']} of {held['guard_window']} readings in the guard's window"
            )
    return lines
