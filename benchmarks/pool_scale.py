"""Pool size benchmark (#16 Performance): retrieval latency and bytes on disk of an embedded store with
10,000 memories, then after eviction to 1,000.

    python -m benchmarks.pool_scale                     # 10k -> 1k, lru, 200 queries
    python -m benchmarks.pool_scale --memories 2000 --keep 200 --out /tmp/p.json   # a quick look

Memories have the default model's shapes (Qwen2.5-Coder-0.5B: k=20 soft-prompt vectors of 896
floats, an ``input`` key of 896 floats) with random soft prompts and synthetic input keys
calibrated to real ones (``benchmarks.retrieval``'s ``InputKeys``); no model is loaded. They
go through the store's own write path (``put_many``: blob, fsync, rename, rows) in batches.

Before eviction, a random fifth of the pool is counted as used (``record_usage``), so ``lru``
keeps the used memories and then the newest. Measured at each size:

- latency of ``store.query`` top-1 alone (the index) and of query + reading the top memory's
  blob (what an answer's retrieval does, without the key build), p50/p95 over ``--queries``
  queries after a warm-up, and recall@1 of the index against exact cosine over the pool;
- bytes on disk per part (blobs, Chroma folder, utility.sqlite3); after eviction also after
  ``compact_index`` (VACUUM of the embedded Chroma database: SQLite otherwise keeps freed pages);
- after eviction, latency again once chromadb's in-process client is dropped and the store
  reopened (what a new process sees), and once more after ``rebuild_index`` (``elm memories
  compact``: the collections rewritten with their live rows, since HNSW keeps deleted entries).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see benchmarks.retrieval

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.retrieval import InputKeys, fake_model, percentiles, reopen_chroma  # noqa: E402
from elm_memory.memory import LatentMemory, TrainingStats  # noqa: E402
from elm_memory.store.chroma import ChromaMemoryStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

NAMESPACE = "bench"
K = 20


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2",))
    except OSError:
        pass
    return []


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def disk(root: Path) -> dict[str, int]:
    parts = {
        "blobs": folder_bytes(root / "blobs"),
        "chroma": folder_bytes(root / "chroma"),
        "utility": sum(p.stat().st_size for p in root.glob("utility.sqlite3*")),
    }
    return {**parts, "total": sum(parts.values())}


def build(store: ChromaMemoryStore, keys: np.ndarray, batch: int) -> dict[str, Any]:
    """Put ``len(keys)`` memories in batches; returns timings."""
    info = store.model
    assert info is not None
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    now = time.time() - len(keys)
    for start in range(0, len(keys), batch):
        memories = []
        for i in range(start, min(start + batch, len(keys))):
            m = LatentMemory.create(
                torch.randn(K, info.hidden_size, generator=g) * 0.02,
                question=f"synthetic question {i}: what is {i} plus {i}?",
                namespace=NAMESPACE,
                model=info,
                stats=TrainingStats(steps=10, majority_answer=str(2 * i), majority_share=0.75),
            )
            m.meta.created_at = now + i
            m.keys = {"input": torch.from_numpy(keys[i])}
            memories.append(m)
        store.put_many(memories)
        done = min(start + batch, len(keys))
        if done % (batch * 4) == 0 or done == len(keys):
            rate = done / (time.perf_counter() - t0)
            print(f"  put {done}/{len(keys)} ({rate:.0f} memories/s)", flush=True)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 1), "memories_per_s": round(len(keys) / seconds, 1), "batch": batch}


def measure(store: ChromaMemoryStore, queries: np.ndarray) -> dict[str, Any]:
    """Index-only and query + blob latency, recall@1 against exact cosine over the current pool."""
    col = store.key_collections("input", NAMESPACE)[0]
    ids, _, matrix = store.key_matrix(col)
    unit = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
    exact = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    best = exact.max(axis=1)
    where = {m: i for i, m in enumerate(ids)}
    for q in queries[:5]:  # warm-up: page cache, HNSW load
        store.query("input", q, NAMESPACE, k=1)
    index_s, full_s, hits = [], [], 0
    for qi, q in enumerate(queries):
        t0 = time.perf_counter()
        [hit] = store.query("input", q, NAMESPACE, k=1)
        t1 = time.perf_counter()
        store.load(hit.record)
        t2 = time.perf_counter()
        index_s.append(t1 - t0)
        full_s.append(t2 - t0)
        hits += exact[qi, where[hit.record.id]] >= best[qi] - 1e-6
    return {
        "memories": len(ids),
        "index_query": percentiles(index_s),
        "query_and_blob": percentiles(full_s),
        "recall_at_1": round(float(hits) / len(queries), 4),
        "load_average": os.getloadavg(),  # a shared machine: what else ran while this was measured
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memories", type=int, default=10_000)
    ap.add_argument("--keep", type=int, default=1_000)
    ap.add_argument("--policy", default="lru", choices=["lru", "utility", "oldest"])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--batch", type=int, default=500, help="memories per put_many")
    ap.add_argument("--used-fraction", type=float, default=0.2, help="share of the pool counted as used")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pool_scale.json")
    ap.add_argument("--workdir", type=Path, default=None, help="where the store is built (default: a temp dir)")
    args = ap.parse_args(argv)

    info = fake_model("packaged")
    rng = np.random.default_rng(0)
    gen = InputKeys(info.hidden_size)
    keys = gen.memories(args.memories, rng)
    queries = gen.queries(args.queries, rng)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="elm-pool-scale-"))
    root = work / "store"
    result: dict[str, Any] = {
        "machine": {
            "cpu": cpu_name(),
            "cpu_flags": cpu_flags(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "chromadb": __import__("chromadb").__version__,
            "load_average_start": os.getloadavg(),
        },
        "settings": {
            "memories": args.memories,
            "keep": args.keep,
            "policy": args.policy,
            "queries": args.queries,
            "k": K,
            "hidden": info.hidden_size,
            "key": "input",
            "used_fraction": args.used_fraction,
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        store = ChromaMemoryStore(root, model=info)
        print(f"building {args.memories} memories in {root}", flush=True)
        result["build"] = build(store, keys, args.batch)
        result["before"] = {**measure(store, queries), "disk_bytes": disk(root)}
        print(f"before: {result['before']}", flush=True)
        used = rng.choice(args.memories, size=int(args.memories * args.used_fraction), replace=False)
        all_ids = [r.id for r in store.list(NAMESPACE)]
        store.record_usage("input", NAMESPACE, [all_ids[i] for i in sorted(used)])
        t0 = time.perf_counter()
        evicted = store.evict(args.policy, args.keep, NAMESPACE)
        result["eviction"] = {"evicted": len(evicted), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"eviction: {result['eviction']}", flush=True)
        after = measure(store, queries)
        after["disk_bytes"] = disk(root)
        t0 = time.perf_counter()
        compacted = store.compact_index()
        after["compact_seconds"] = round(time.perf_counter() - t0, 1)
        after["disk_bytes_after_compact"] = disk(root) if compacted else None
        after["check_ok"] = store.check().ok
        # a fresh process's view: chromadb reloads the index from disk (deleted entries included)
        reopen_chroma()
        after["reopened"] = measure(ChromaMemoryStore(root, model=info), queries)
        # then the collections rewritten with their live rows (`elm memories compact`)
        store = ChromaMemoryStore(root, model=info)
        t0 = time.perf_counter()
        rows = store.rebuild_index(NAMESPACE)
        store.compact_index()
        rebuild_s = time.perf_counter() - t0
        reopen_chroma()
        after["rebuilt"] = {
            "rows": rows,
            "seconds": round(rebuild_s, 1),
            **measure(ChromaMemoryStore(root, model=info), queries),
            "disk_bytes": disk(root),
        }
        result["after"] = after
        print(f"after: {after}", flush=True)
        b, a = result["before"], result["after"]
        result["ratios_before_over_after"] = {
            "index_query_p50": round(b["index_query"]["p50_ms"] / a["index_query"]["p50_ms"], 2),
            "query_and_blob_p50": round(b["query_and_blob"]["p50_ms"] / a["query_and_blob"]["p50_ms"], 2),
            "index_query_p50_rebuilt": round(b["index_query"]["p50_ms"] / a["rebuilt"]["index_query"]["p50_ms"], 2),
            "disk_total": round(b["disk_bytes"]["total"] / a["disk_bytes"]["total"], 2),
            "disk_total_rebuilt": round(b["disk_bytes"]["total"] / a["rebuilt"]["disk_bytes"]["total"], 2),
            "disk_total_after_compact": round(b["disk_bytes"]["total"] / a["disk_bytes_after_compact"]["total"], 2)
            if a["disk_bytes_after_compact"]
            else None,
        }
        result["machine"]["load_average_end"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"ratios: {result['ratios_before_over_after']} -> {args.out}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
