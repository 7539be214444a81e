"""Whether the stores of run_learn8.sh hold the same memories bit for bit: every blob file's bytes, by
relative path (memory ids are derived from the question and the model, so paths match across runs).

    python benchmarks/results/weight_prepack/same_memories.py /tmp/wp_store_1_off /tmp/wp_store_2_auto ...
"""

import hashlib
import json
import sys
from pathlib import Path


def digest(store: str) -> dict[str, str]:
    root = Path(store) / "blobs"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


stores = {s: digest(s) for s in sys.argv[1:]}
first = next(iter(stores.values()))
print(json.dumps({s: {"blobs": len(d), "same_as_first": d == first} for s, d in stores.items()}, indent=1))
