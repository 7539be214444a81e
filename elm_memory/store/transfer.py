"""Moving memories in and out of a store: standalone safetensors files and PEFT prompt-tuning adapters.

What ``elm memories export`` and ``import`` do besides parsing their arguments: choosing safe
file names, checking memories against the models prepared on this machine, and rebuilding
the retrieval keys of an imported adapter (the only step that loads a model). torch and
chromadb are imported inside the functions, so the CLI's ``--help`` stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elm_memory.errors import StoreError

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.memory import LatentMemory
    from elm_memory.models.loading import ModelInfo
    from elm_memory.store.base import MemoryRecord
    from elm_memory.store.chroma import ChromaMemoryStore


def prepared_models() -> dict[str, Any]:
    """Fingerprint -> ModelInfo of the models prepared on this machine, read from their folders
    (``elm_model.json`` and ``config.json``) without loading weights: what an import is checked against."""
    from types import SimpleNamespace

    from elm_memory.models.loading import ModelInfo
    from elm_memory.models.prepare import MARKER, elm_home

    out: dict[str, Any] = {}
    for marker in sorted((elm_home() / "models").glob(f"*/{MARKER}")):
        try:
            fingerprint = json.loads(marker.read_text(encoding="utf-8"))["embedding_fingerprint"]
            cfg = json.loads((marker.parent / "config.json").read_text(encoding="utf-8"))
            out[fingerprint] = ModelInfo.from_config(
                SimpleNamespace(**cfg),
                name=marker.parent.name,
                path=str(marker.parent),
                vocab_size=int(cfg.get("vocab_size", 0)),
                dtype="float32",
                device="cpu",
                fingerprint=fingerprint,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a half-prepared or foreign folder: nothing to check against
    return out


def export_path(out: Path, memory_id: str) -> Path:
    """``out/<id>.safetensors``, refusing an id that is not plain hex (a store written by an older
    version may hold one): an id must never name a file outside ``out``."""
    from elm_memory.memory.ids import validate_memory_id

    validate_memory_id(memory_id)
    path = out / f"{memory_id}.safetensors"
    if path.parent != out:  # cannot happen for hex; a second guard costs nothing
        raise StoreError(f"memory id {memory_id!r} does not name a file in {out}")
    return path


def export_files(s: ChromaMemoryStore, records: list[MemoryRecord], out: Path, single_file: bool) -> list[str]:
    """One ``<id>.safetensors`` per memory in folder ``out``, or ``out`` itself for one (``single_file``)."""
    paths = [out if single_file else export_path(out, r.id) for r in records]  # all checked before writing
    written = []
    for r, path in zip(records, paths, strict=True):
        s.load(r).save(path)
        written.append(str(path))
    return written


def export_peft(s: ChromaMemoryStore, records: list[MemoryRecord], out: Path, cfg: ELMConfig) -> list[str]:
    """One adapter folder per memory: ``out`` itself for one, ``out/<id>`` for several. Every memory is
    loaded and checked (prefix position) before the first folder is written."""
    from elm_memory.memory.ids import validate_memory_id
    from elm_memory.memory.peft import memory_position, require_prefix

    memories = [s.load(r) for r in records]
    for m in memories:
        validate_memory_id(m.id)  # names a folder below
        require_prefix(m, memory_position(m, cfg.prompt.soft_prompt_position))
    models = prepared_models()
    return [_adapter(m, out if len(memories) == 1 else out / m.id, models) for m in memories]


def _adapter(memory: LatentMemory, folder: Path, models: dict[str, Any]) -> str:
    """Write one prefix memory as a PEFT adapter, naming its prepared base model where this machine has it."""
    from elm_memory.memory.peft import export_adapter

    info = models.get(memory.meta.model_fingerprint)
    base = info.path if info is not None else memory.meta.model_name
    return str(export_adapter(memory, folder, position="prefix", base_model=base))


def export_stream(cfg: ELMConfig, namespace: str, version: int | None, out: Path, format_: str) -> str:
    """One stream memory version (default: the serving one) as a memory file (``out``, or ``out/<id>.safetensors``
    for a folder) or a PEFT adapter folder (prompt tuning for a soft prompt, LoRA for a lora stream memory). Its
    metadata keeps the history that trained it."""
    from elm_memory.memory.peft import memory_position, require_prefix
    from elm_memory.store.stream_files import StreamFiles, stream_root

    files = StreamFiles(stream_root(cfg.store.path), namespace)
    if files.current_version() is None:
        raise StoreError(f"namespace {namespace!r} has no stream memory under {files.dir.parent}")
    memory, _ = files.read(version)
    if format_ == "peft":
        if memory.kind == "soft_prompt":  # a lora stream memory is a PEFT LoRA adapter wherever prompts go
            require_prefix(memory, memory_position(memory, cfg.prompt.soft_prompt_position))
        return _adapter(memory, out, prepared_models())
    path = out if out.suffix == ".safetensors" else export_path(out, memory.id)
    memory.save(path)
    return str(path)


def read_imports(files: list[Path], cfg: ELMConfig) -> tuple[list[LatentMemory], list[tuple[Path, LatentMemory]]]:
    """Memory files and adapter folders to import: (memories, (folder, memory) of each adapter, keys not built).

    Adapters get their cheap checks against the config here, before any model loads."""
    from elm_memory.errors import AdapterError
    from elm_memory.memory import LatentMemory
    from elm_memory.memory.peft import check_adapter, is_adapter_dir, read_adapter

    memories, adapters = [], []
    for f in files:
        if is_adapter_dir(f):
            memory, _ = read_adapter(f)
            check_adapter(memory, f, cfg, None)
            adapters.append((f, memory))
        elif f.is_dir():
            raise AdapterError(f"{f} is a folder without adapter_config.json (not a PEFT adapter)")
        else:
            memories.append(LatentMemory.load(f))
    return memories, adapters


def rebuild_keys(adapters: list[tuple[Path, LatentMemory]], cfg: ELMConfig) -> ModelInfo:
    """Load the configured model, check each adapter against it and fill its keys with the configured
    key builder (what :class:`~elm_memory.retrieval.retriever.Retriever` files new memories with)."""
    import torch

    from elm_memory.memory.keys import key_builders, memory_inputs, tokenize_question
    from elm_memory.memory.peft import check_adapter
    from elm_memory.models.loading import load_model

    builder = key_builders.get(cfg.retrieval.key)()
    loaded = load_model(cfg.model)
    for folder, memory in adapters:
        check_adapter(memory, folder, cfg, loaded.info)
    memories = [m for _, m in adapters]
    ids = [tokenize_question(loaded.tokenizer, m.meta.question) for m in memories]
    keys = builder.memory_keys(loaded, memory_inputs(loaded, memories, ids, builder.kind), ids)
    for m, key in zip(memories, keys, strict=True):
        m.keys = {builder.kind: key.detach().to("cpu", torch.float32).contiguous()}
        m.validate()
    return loaded.info
