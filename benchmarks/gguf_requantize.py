"""Re-quantize the packaged GGUF to one llama.cpp type (#54's pilot: does a type llama.cpp repacks for its CPU
matrix kernels, e.g. Q4_0, change the 8-row picture?).

    PYTHONPATH=DIR python -m benchmarks.gguf_requantize SRC.gguf OUT_DIR --types q4_0,q8_0

``DIR`` holds ``llama_cpp`` (built from source, see ``benchmarks/cpu_decode_pilot.py``). Re-quantizing an already
quantized file loses more than quantizing from the bf16 weights would; this is a speed probe, not a product path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

#: llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` numbers for the types worth probing on a CPU.
FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--types", default="q4_0,q8_0", help=f"comma-separated, of {sorted(FTYPES)}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import llama_cpp as lc

    unknown = sorted(set(args.types.split(",")) - set(FTYPES))
    if unknown:
        ap.error(f"unknown type(s) {unknown}; known: {sorted(FTYPES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for name in args.types.split(","):
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[name], True, args.threads
        out = args.out_dir / f"{args.src.stem}-{name}.gguf"
        t0 = time.perf_counter()
        rc = lc.llama_model_quantize(str(args.src).encode(), str(out).encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize to {name} failed with {rc}")
        done[name] = {"path": str(out), "bytes": out.stat().st_size, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(done, indent=1))


if __name__ == "__main__":
    main()
