"""Issue #66: why two llama.cpp rows cost nearly twice one. A decode step's time at 1, 2, 4 and 8 rows, on 1 and 2
threads, on the packaged model's GGUF through the library's own engine (``elm_memory/backends/llama_rows.py``).

If a step is bound by reading the weights, more rows cost little more than one (the weights are read once per step)
and a second thread helps little once the memory bus is full; if it is bound by arithmetic (unpacking each 4- and
5-bit block again for every row), the step grows with the rows and a second thread nearly halves it.

    python -m benchmarks.llama_row_scaling --json benchmarks/results/answer_rows/llama_row_scaling.json

Needs the optional extra ``elm-memory[llama]``. Time it on quiet cores only; ratios inside one run compare.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.cpu_decode_pilot import _cpu_model, _git_head, _loadavg


def step_ms(engine: Any, rows: int, prompt: list[int], tokens: int, rounds: int) -> float:
    """Milliseconds per decode step at ``rows`` greedy rows (the better of ``rounds``): a run of ``tokens`` new tokens
    less a run of one (the prefill and set-up), over the steps between."""
    from elm_memory.backends.decode import DecodeOptions

    def run(n: int) -> float:
        t0 = time.perf_counter()
        engine.sample([prompt], [DecodeOptions(n=rows, max_new_tokens=n, temperature=0.0)])
        return time.perf_counter() - t0

    best = float("inf")
    for _ in range(rounds):
        best = min(best, (run(tokens + 1) - run(1)) / tokens)
    return 1000.0 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()

    from elm_memory.backends.llama_rows import LlamaRows, available
    from elm_memory.models.prepare import packaged_gguf

    if (why := available()) is not None:
        raise SystemExit(why)
    gguf = packaged_gguf("packaged:qwen2.5-coder-0.5b")
    rows = [int(r) for r in args.rows.split(",")]
    prompt = list(range(1000, 1100))  # 100 token ids: the prompt's content does not change a step's cost
    cells = []
    load_before = _loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (int(t) for t in args.threads.split(",")):
            engine = LlamaRows(gguf, threads=threads, adapter_dir=Path(tmp), rows=max(rows), context_per_row=256)
            try:
                step_ms(engine, 1, prompt, 4, 1)  # warm-up
                for n in rows:
                    ms = step_ms(engine, n, prompt, args.tokens, args.rounds)
                    cells.append({"threads": threads, "rows": n, "ms_per_step": round(ms, 2)})
                    print(f"threads {threads}  rows {n}: {ms:.1f} ms/step", flush=True)
            finally:
                engine.close()
    by = {(c["threads"], c["rows"]): c["ms_per_step"] for c in cells}
    out = {
        "machine": {"cpu_model": _cpu_model(), "load_start_end": [load_before, _loadavg()]},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git_head(),
        "gguf": gguf.name,
        "tokens": args.tokens,
        "cells": cells,
        # a step at n rows against one row, per thread count: 1.0 is bytes-bound, n is arithmetic-bound
        "row_cost": {
            f"{t}threads_{n}rows": round(by[(t, n)] / by[(t, 1)], 2) for (t, n) in by if (t, 1) in by and n != 1
        },
        # one thread against two, per row count: near 1 is bytes-bound, near 2 arithmetic-bound
        "thread_gain": {f"{n}rows": round(by[(1, n)] / by[(2, n)], 2) for (t, n) in by if t == 1 and (2, n) in by},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
