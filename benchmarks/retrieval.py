"""Retrieval benchmark: query latency (p50/p95), recall@1 against exact brute force, and insert
throughput of the Chroma memory store, for both key kinds, at 1k / 10k / 100k memories.

    python -m benchmarks.retrieval --quick                          # 1k + 10k, all profiles and kinds
    python -m benchmarks.retrieval --sizes 100000 --profiles 7b --kinds kv   # one 100k cell (split runs)

Every run merges its cells into ``benchmarks/results/retrieval.json`` (keyed by
profile/kind/size), so the 100k cells can be produced by separate invocations, each
within the 10-minute budget.

Profiles (key dimensions): ``packaged`` = Qwen2.5-Coder-0.5B (input 896, kv 24x64=1536);
``7b`` = Qwen2.5-Math-7B (input 3584, kv 28x128=3584).

Synthetic keys, calibrated to real ones. Measured on SmolLM2-135M with 120 vendored
questions (60 GSM8K + 60 MATH500; memories = question embeddings tiled to k=20):
input keys have mean pairwise cosine 0.76 (std 0.10) and a participation ratio ~11
(a strong common direction plus few directions of variation); KV memory keys are
concentrated (mean pairwise cosine 0.95), KV query keys even more (0.98), and the
query-memory score (mean of per-layer cosines) is 0.067 +- 0.018 with a top-1/top-2
gap of only 0.005 -- queries sit far from all memories, the known hard case for HNSW.
The generators below reproduce those statistics (each cell records what it produced
under ``data``): input keys = common direction + power-law spectrum over a 128-dim
subspace; KV keys = per layer a unit vector of (layer mean + shared latent mapped into
the layer), memories and queries with different means and spreads.

recall@1 counts a query as correct when the returned memory's exact score is within
1e-6 of the brute-force best (ties within float32 noise are not misses).
"""

from __future__ import annotations

import os

# The brute-force baseline runs on one BLAS thread: on a shared 2-core box a multi-threaded
# BLAS spin-waits and its timings say more about the neighbours than about the method.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from elm_memory.models.loading import ModelInfo  # noqa: E402
from elm_memory.store.chroma import DEFAULT_HNSW, KIND_HNSW, ChromaMemoryStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Profile(TypedDict):
    model: str
    hidden: int
    layers: int
    head_dim: int


PROFILES: dict[str, Profile] = {
    "packaged": {"model": "Qwen2.5-Coder-0.5B", "hidden": 896, "layers": 24, "head_dim": 64},
    "7b": {"model": "Qwen2.5-Math-7B", "hidden": 3584, "layers": 28, "head_dim": 128},
}
BATCH = 1000
NAMESPACE = "bench"


# ---- synthetic keys ----------------------------------------------------------------------


def _orthonormal(rng: np.random.Generator, d: int, r: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, r)))
    return q.astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class InputKeys:
    """Mean input embeddings: shared direction + power-law variation in a low-dim subspace."""

    def __init__(self, dim: int, seed: int = 0, rank: int = 128, spread: float = 0.57, noise: float = 0.02):
        rng = np.random.default_rng(seed)
        self.dim, self.rank = dim, min(rank, dim - 1)
        basis = _orthonormal(rng, dim, self.rank + 1)
        self.mean, self.basis = basis[:, 0], basis[:, 1:]
        s = np.arange(1, self.rank + 1, dtype=np.float32) ** -0.65
        self.scale = (spread * s / np.linalg.norm(s)).astype(np.float32)
        self.noise = noise / np.sqrt(dim)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        z = rng.standard_normal((n, self.rank), dtype=np.float32) * self.scale
        x = self.mean + z @ self.basis.T + self.noise * rng.standard_normal((n, self.dim), dtype=np.float32)
        return x.astype(np.float32)

    memories = queries = sample


class KVKeys:
    """Concatenated per-layer unit vectors; memory (k_proj) and query (q_proj) sides differ in mean and spread.

    Per layer l: memory block = unit(m_l + 0.21 U_l (z + 0.4 n_l)), query block = unit(mu_l + 0.14 U_l (z' + 0.4 n'_l))
    with one latent z per key shared by all layers; the query mean mu_l has cosine rho_l with m_l (layer-dependent,
    mean 0.067) and a component 0.3 along a latent direction, so the memory spread is visible to queries.
    """

    def __init__(self, layers: int, head_dim: int, seed: int = 0, rank: int = 32):
        rng = np.random.default_rng(seed)
        self.L, self.hd, self.rank = layers, head_dim, min(rank, head_dim - 2)
        r = rng.standard_normal(layers)
        self.rho = np.clip(0.067 + 0.2 * (r - r.mean()) / r.std(), -0.9, 0.9).astype(np.float32)
        self.bases = [_orthonormal(rng, head_dim, self.rank + 2) for _ in range(layers)]  # columns: m_l, e_l, U_l
        self.w = _unit(rng.standard_normal(self.rank)).astype(np.float32)
        s = np.arange(1, self.rank + 1, dtype=np.float32) ** -0.5
        self.s = (s / np.linalg.norm(s)).astype(np.float32)

    def _side(self, n: int, rng: np.random.Generator, query: bool, beta: float = 0.3) -> np.ndarray:
        z = rng.standard_normal((n, self.rank), dtype=np.float32) * self.s  # shared by all layers
        out = np.empty((n, self.L * self.hd), dtype=np.float32)
        spread = 0.14 if query else 0.21  # per-layer self-cosines ~0.98 (queries) and ~0.95 (memories)
        for layer, b in enumerate(self.bases):
            mk, e, u = b[:, 0], b[:, 1], b[:, 2:]
            if query:
                rho = float(self.rho[layer])
                mean = rho * mk + beta * (u @ self.w) + np.sqrt(max(1 - rho**2 - beta**2, 0.0)) * e
            else:
                mean = mk
            own = rng.standard_normal((n, self.rank), dtype=np.float32) * self.s * 0.4
            out[:, layer * self.hd : (layer + 1) * self.hd] = _unit(mean + spread * ((z + own) @ u.T))
        return out

    def memories(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self._side(n, rng, query=False)

    def queries(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self._side(n, rng, query=True)


def generator(profile: str, kind: str) -> InputKeys | KVKeys:
    p = PROFILES[profile]
    return InputKeys(p["hidden"]) if kind == "input" else KVKeys(p["layers"], p["head_dim"])


def data_stats(mem: np.ndarray, qry: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """The calibration statistics (see module doc) on a sample of the generated keys."""
    m = _unit(mem[rng.choice(len(mem), min(len(mem), 500), replace=False)])
    q = _unit(qry[: min(len(qry), 200)])
    off = (m @ m.T)[~np.eye(len(m), dtype=bool)]
    cross = q @ m.T
    top = np.sort(cross, axis=1)[:, -2:]
    return {
        "memory_pairwise_cos": round(float(off.mean()), 4),
        "query_memory_cos_mean": round(float(cross.mean()), 4),
        "query_memory_cos_std": round(float(cross.std()), 4),
        "top1_top2_gap_500": round(float((top[:, 1] - top[:, 0]).mean()), 5),
    }


# ---- measurement ---------------------------------------------------------------------------


def fake_model(profile: str) -> ModelInfo:
    p = PROFILES[profile]
    heads = p["hidden"] // p["head_dim"]
    return ModelInfo(
        name=p["model"],
        path="",
        model_type="qwen2",
        hidden_size=p["hidden"],
        num_layers=p["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 7),
        head_dim=p["head_dim"],
        vocab_size=1,
        max_context=1,
        dtype="bfloat16",
        device="cpu",
        fingerprint=f"bench{profile}".ljust(16, "0")[:16],
    )


def row_meta(i: int, now: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Index metadata of realistic size (same fields the store writes)."""
    return {
        "namespace": NAMESPACE,
        "created_at": now + i,
        "question_hash": f"{i:064x}",
        "question": f"synthetic {i}",
        "blob": f"{i:064x}",
        "num_tokens": 20,
        "usage": 0,
        "last_used_at": 0.0,
        "no_consensus": False,
        "train_engine": "native",
        "train_objective": "grpo",
        "train_steps": 10,
        "train_seconds": 1.0,
        "train_reward": 0.5,
        "majority_share": 0.5,
        **(extra or {}),
    }


def insert(
    col: Any, vectors: np.ndarray, start: int = 0, extra=None, deadline: float | None = None
) -> tuple[int, float]:
    """Add rows ``start..`` in batches of BATCH until done or ``deadline``; return (rows added, seconds)."""
    now = time.time()
    t0 = time.perf_counter()
    done = 0
    for i in range(start, len(vectors), BATCH):
        if deadline is not None and time.perf_counter() > deadline:
            break
        chunk = vectors[i : i + BATCH]
        ids = [f"m{i + j}" for j in range(len(chunk))]
        metas = [row_meta(i + j, now, extra(i + j) if extra else None) for j in range(len(chunk))]
        col.add(ids=ids, embeddings=chunk, metadatas=metas)
        done += len(chunk)
    return done, time.perf_counter() - t0


def insert_all(col: Any, vectors: np.ndarray, extra=None) -> float:
    n, seconds = insert(col, vectors, extra=extra)
    return n / seconds


def reopen_chroma() -> None:
    """Drop chromadb's in-process clients so the next open reloads the index with the stored settings.

    chromadb 1.5.9 (embedded) reads ``ef_search`` when it loads an index; a ``modify`` does not
    reach an index this process already searched.
    """
    from chromadb.api.client import SharedSystemClient

    SharedSystemClient.clear_system_cache()


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p95_ms": round(float(np.percentile(ms, 95)), 3)}


def recall_and_latency(query_fn, mem_unit: np.ndarray, queries: np.ndarray, ids: list[str] | None = None) -> dict:
    """Latency of ``query_fn(vector) -> id`` and recall@1 against exact cosine brute force."""
    exact = _unit(queries) @ mem_unit.T
    best = exact.max(axis=1)
    index = {f"m{i}": i for i in range(len(mem_unit))} if ids is None else {m: i for i, m in enumerate(ids)}
    for q in queries[:5]:  # warm-up (page cache, HNSW load)
        query_fn(q)
    times, hits = [], 0
    for qi, q in enumerate(queries):
        t0 = time.perf_counter()
        got = query_fn(q)
        times.append(time.perf_counter() - t0)
        hits += got is not None and exact[qi, index[got]] >= best[qi] - 1e-6
    return {**percentiles(times), "recall_at_1": round(hits / len(queries), 4)}


def brute_force_latency(mem_unit: np.ndarray, queries: np.ndarray) -> dict:
    times = []
    for q in queries[:50]:
        t0 = time.perf_counter()
        int(np.argmax(mem_unit @ (q / np.linalg.norm(q))))
        times.append(time.perf_counter() - t0)
    return percentiles(times)


@dataclass
class Cell:
    profile: str
    kind: str
    size: int

    @property
    def key(self) -> str:
        return f"{self.profile}/{self.kind}/{self.size}"


def run_cell(
    cell: Cell, work: Path, n_queries: int, ef_values: list[int] | None, hnsw: dict, deadline: float
) -> dict[str, Any]:
    """Build (or resume building) one index, then sweep ef_search. Incomplete builds resume on the next run."""
    gen = generator(cell.profile, cell.kind)
    rng = np.random.default_rng(1000 + cell.size)
    mem = np.concatenate([gen.memories(min(10_000, cell.size - i), rng) for i in range(0, cell.size, 10_000)])
    qry = gen.queries(n_queries, np.random.default_rng(7))
    info = fake_model(cell.profile)
    folder = work / cell.key.replace("/", "-")
    state_file = folder / "bench-state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {"rows": 0, "seconds": 0.0}
    store = ChromaMemoryStore(folder, model=info, hnsw=hnsw)
    settings = store.hnsw_settings(cell.kind)
    _, col = store._create(info.fingerprint, cell.kind, NAMESPACE, info.hidden_size, mem.shape[1])
    start = col.count()
    added, seconds = insert(col, mem, start=start, deadline=deadline)
    state = {"rows": state["rows"] + added, "seconds": state["seconds"] + seconds}
    state_file.write_text(json.dumps(state))
    rate = state["rows"] / state["seconds"] if state["seconds"] else float("nan")
    result: dict[str, Any] = {
        "profile": cell.profile,
        "model": PROFILES[cell.profile]["model"],
        "kind": cell.kind,
        "size": cell.size,
        "dim": int(mem.shape[1]),
        "queries": n_queries,
        "insert_rows_per_s": round(rate, 1),
        "insert_batch": BATCH,
        "hnsw": settings,
        "rows_indexed": start + added,
    }
    print(f"  {cell.key}: {start + added}/{cell.size} rows x {mem.shape[1]} indexed, {rate:.0f} rows/s", flush=True)
    if start + added < cell.size:
        result["complete"] = False
        print("    time budget used up: run again with the same --workdir to continue", flush=True)
        return result
    result["complete"] = True
    result["data"] = data_stats(mem, qry, rng)
    mem /= np.linalg.norm(mem, axis=1, keepdims=True)  # in place: 100k x 3584 is 1.4 GB
    result["brute_force_numpy_1thread"] = brute_force_latency(mem, qry)
    result["by_ef_search"] = {}
    for ef in ef_values or [settings["ef_search"]]:
        reopen_chroma()
        tuned = ChromaMemoryStore(folder, model=info, hnsw={**hnsw, "ef_search": ef})  # applies ef on open

        def via_store(q: np.ndarray, tuned: ChromaMemoryStore = tuned) -> str | None:
            hits = tuned.query(cell.kind, q, NAMESPACE, k=1)
            return hits[0].record.id if hits else None

        r = recall_and_latency(via_store, mem, qry)
        result["by_ef_search"][str(ef)] = r
        print(
            f"    ef_search={ef}: p50 {r['p50_ms']} ms  p95 {r['p95_ms']} ms  recall@1 {r['recall_at_1']}", flush=True
        )
    return result


def namespace_isolation(work: Path, profile: str, kind: str, size: int, n_queries: int, hnsw: dict) -> dict:
    """Where-filter on one shared collection vs a collection per namespace vs a database per namespace."""
    import chromadb
    from chromadb.config import Settings

    gen = generator(profile, kind)
    rng = np.random.default_rng(5)
    mem = gen.memories(size, rng)
    qry = gen.queries(n_queries, np.random.default_rng(8))
    info = fake_model(profile)
    store = ChromaMemoryStore(work / "namespaces", model=info, hnsw=hnsw)
    _, shared = store._create(info.fingerprint, kind, NAMESPACE, info.hidden_size, mem.shape[1])
    rate = insert_all(shared, mem, extra=lambda i: {"ns4": f"ns{i % 4}"})
    quarter = np.arange(0, size, 4)  # the rows of namespace ns0
    mem_unit, q_unit = _unit(mem), _unit(mem[quarter])

    def q(col, where=None):
        def fn(v: np.ndarray) -> str | None:
            res = col.query(query_embeddings=v[None], n_results=1, include=["distances", "metadatas"], where=where)
            return res["ids"][0][0] if res["ids"][0] else None

        return fn

    out: dict[str, Any] = {
        "profile": profile,
        "kind": kind,
        "size": size,
        "dim": int(mem.shape[1]),
        "insert_rows_per_s": round(rate, 1),
    }
    out["one_collection_no_filter"] = recall_and_latency(q(shared), mem_unit, qry)
    out["one_collection_where_all_rows_match"] = recall_and_latency(q(shared, {"namespace": NAMESPACE}), mem_unit, qry)
    ids_q = [f"m{i}" for i in quarter]
    out["one_collection_where_quarter_match"] = recall_and_latency(q(shared, {"ns4": "ns0"}), q_unit, qry, ids_q)
    _, own = store._create(info.fingerprint, kind, "ns0", info.hidden_size, mem.shape[1])
    for j in range(0, len(quarter), BATCH):
        part = quarter[j : j + BATCH]
        own.add(ids=[f"m{i}" for i in part], embeddings=mem[part], metadatas=[row_meta(int(i), 0.0) for i in part])
    out["collection_per_namespace_quarter"] = recall_and_latency(q(own), q_unit, qry, ids_q)
    chroma_dir = str(work / "namespaces" / "chroma")
    settings = Settings(anonymized_telemetry=False, is_persistent=True, persist_directory=chroma_dir)
    chromadb.AdminClient(settings).create_database("ns0")
    # Any, as the library's client is: chromadb types `configuration` as a TypedDict the plain dict does not name
    db_client: Any = chromadb.PersistentClient(path=chroma_dir, settings=settings, database="ns0")
    db_col = db_client.create_collection(
        "bench-ns0", configuration={"hnsw": store.hnsw_settings(kind)}, embedding_function=None
    )
    for j in range(0, len(quarter), BATCH):
        part = quarter[j : j + BATCH]
        db_col.add(ids=[f"m{i}" for i in part], embeddings=mem[part], metadatas=[row_meta(int(i), 0.0) for i in part])
    out["database_per_namespace_quarter"] = recall_and_latency(q(db_col), q_unit, qry, ids_q)
    for name, r in out.items():
        if isinstance(r, dict):
            print(f"  {name}: p50 {r['p50_ms']} ms  p95 {r['p95_ms']} ms  recall@1 {r['recall_at_1']}", flush=True)
    return out


def blob_put_rate(work: Path, profile: str, n: int) -> dict[str, Any]:
    """End-to-end ``put`` (safetensors blob with fsync + index rows) for real-sized memories."""
    import torch

    from elm_memory.memory import LatentMemory

    info = fake_model(profile)
    store = ChromaMemoryStore(work / f"puts-{profile}", model=info)
    gen_in, gen_kv = generator(profile, "input"), generator(profile, "kv")
    rng = np.random.default_rng(3)
    keys_in, keys_kv = gen_in.memories(n, rng), gen_kv.memories(n, rng)
    mems = []
    for i in range(n):
        m = LatentMemory.create(torch.randn(20, info.hidden_size), question=f"q{i}", namespace=NAMESPACE, model=info)
        m.keys = {"input": torch.from_numpy(keys_in[i]), "kv": torch.from_numpy(keys_kv[i])}
        mems.append(m)
    t0 = time.perf_counter()
    for m in mems[: n // 2]:
        store.put(m)
    single = (n // 2) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    store.put_many(mems[n // 2 :])
    batched = (n - n // 2) / (time.perf_counter() - t0)
    return {
        "profile": profile,
        "memories": n,
        "blob_bytes": len(mems[0].to_bytes()),
        "keys": ["input", "kv"],
        "put_per_s": round(single, 1),
        "put_many_per_s": round(batched, 1),
    }


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k and 10k only (plus the namespace and put sections)")
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--profiles", default="packaged,7b")
    ap.add_argument("--kinds", default="input,kv")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--ef-search", default=None, help="comma list to sweep (default: the store's value per kind)")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="per cell: stop inserting after this many seconds; rerun with the same --workdir to resume",
    )
    ap.add_argument("--ef-construction", type=int, default=None)
    ap.add_argument("--max-neighbors", type=int, default=None)
    ap.add_argument("--skip-namespaces", action="store_true")
    ap.add_argument("--skip-puts", action="store_true")
    ap.add_argument("--namespace-size", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "retrieval.json")
    ap.add_argument("--workdir", type=Path, default=None, help="where the stores are built (default: a temp dir)")
    args = ap.parse_args(argv)

    sizes = [1000, 10_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    hnsw: dict[str, Any] = {}  # overrides of the store's per-kind settings
    if args.ef_construction:
        hnsw["ef_construction"] = args.ef_construction
    if args.max_neighbors:
        hnsw["max_neighbors"] = args.max_neighbors
    ef_values = [int(e) for e in args.ef_search.split(",")] if args.ef_search else None

    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.setdefault("cells", {})
    results["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "chromadb": __import__("chromadb").__version__,
    }
    results["defaults"] = {"hnsw": DEFAULT_HNSW, "hnsw_by_kind": KIND_HNSW, "insert_batch": BATCH}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="elm-retrieval-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True))

    try:
        t_start = time.perf_counter()
        if not args.skip_namespaces:
            print(f"namespace isolation ({args.namespace_size} rows, packaged kv):", flush=True)
            results["namespace_isolation"] = namespace_isolation(
                work, "packaged", "kv", args.namespace_size, args.queries, hnsw
            )
            save()
        if not args.skip_puts:
            results["put_throughput"] = {p: blob_put_rate(work, p, 200) for p in args.profiles.split(",")}
            print(f"put throughput: {results['put_throughput']}", flush=True)
            save()
        for size in sizes:
            for profile in args.profiles.split(","):
                for kind in args.kinds.split(","):
                    cell = Cell(profile, kind, size)
                    deadline = time.perf_counter() + args.time_budget
                    results["cells"][cell.key] = run_cell(cell, work, args.queries, ef_values, hnsw, deadline)
                    results["cells"][cell.key]["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                    save()
                    if not results["cells"][cell.key]["complete"] and args.workdir is None:
                        print("    (pass --workdir DIR to keep a partial build and resume it)", flush=True)
        print(f"done in {time.perf_counter() - t_start:.0f} s -> {args.out}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
