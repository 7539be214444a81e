"""A LoRA memory as a llama.cpp LoRA adapter file (GGUF), written with the ``gguf`` package.

llama.cpp applies an adapter file to a loaded GGUF model: per target weight ``blk.N.attn_q.weight`` it reads
``blk.N.attn_q.weight.lora_a`` (r x in) and ``....lora_b`` (out x r), in the same row-major shapes as PEFT's A and
B, and scales ``B A x`` by ``adapter.lora.alpha / r``. The module names are mapped with the ``gguf`` package's own
table for the architecture, so a model the table does not know is a typed error, never a silent mismatch.

One layout differs between the two formats. For ``llama``-architecture GGUFs the converter reorders the rows of the
query and key projections within each head (the two halves of a head's rotary pairs interleaved: GGML's rotary
layout, where Hugging Face keeps them in halves), and transformers undoes it on loading. A LoRA's ``B`` writes
those rows, so it is reordered the same way here. Qwen2 GGUFs keep Hugging Face's layout. Any other architecture is
refused until its layout is checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from elm_memory.errors import MemoryFormatError
from elm_memory.memory.lora import LoraAdapter

#: GGUF architectures whose query/key rows are interleaved per head (see above), and those that keep HF's layout.
INTERLEAVED_QK = frozenset({"llama"})
HF_LAYOUT = frozenset({"qwen2"})


def interleave_heads(rows: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a query or key projection (``heads`` heads) in GGML's rotary layout: within each head, the first
    and second halves of the rows interleaved (row i of the first half, then row i of the second, ...)."""
    if rows.shape[0] % (2 * heads):
        raise MemoryFormatError(f"{rows.shape[0]} rows do not split into {heads} heads of rotary pairs")
    per_half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, per_half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensor_names(adapter: LoraAdapter, arch: str, n_blocks: int) -> dict[str, str]:
    """The GGUF name of each target module's weight (``model.layers.0.self_attn.q_proj`` ->
    ``blk.0.attn_q.weight``) for architecture ``arch`` (a GGUF ``general.architecture``, e.g. ``qwen2``)."""
    import gguf

    known = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in known:
        raise MemoryFormatError(f"the gguf package knows no architecture {arch!r}")
    table = gguf.get_tensor_name_map(known[arch], n_blocks)
    names = {}
    for module in adapter.weights:
        mapped = table.get_name(module + ".weight", try_suffixes=(".weight",))
        if mapped is None:
            raise MemoryFormatError(f"lora module {module!r} has no GGUF name for architecture {arch!r}")
        names[module] = mapped
    return names


def write_gguf_lora(
    adapter: LoraAdapter,
    path: str | os.PathLike[str],
    *,
    arch: str,
    n_blocks: int,
    heads: int = 0,
    kv_heads: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write ``adapter`` to ``path`` (atomically) as a llama.cpp LoRA adapter for a ``arch`` model with ``n_blocks``
    layers, ``heads`` query heads and ``kv_heads`` key/value heads (needed where the GGUF interleaves them);
    ``dtype`` ``float32`` or ``float16``."""
    import gguf

    if dtype not in ("float32", "float16"):
        raise ValueError(f"a GGUF LoRA is written in float32 or float16, not {dtype}")
    if arch not in INTERLEAVED_QK | HF_LAYOUT:
        raise MemoryFormatError(
            f"a LoRA for a {arch!r} GGUF: its query/key layout is not checked; one of "
            f"{sorted(INTERLEAVED_QK | HF_LAYOUT)}"
        )
    if arch in INTERLEAVED_QK and (heads <= 0 or kv_heads <= 0):
        raise ValueError(f"a LoRA for a {arch!r} GGUF needs the model's heads and kv_heads")
    names = gguf_tensor_names(adapter, arch, n_blocks)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    writer = gguf.GGUFWriter(str(partial), arch)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, adapter.alpha)
        for module in sorted(adapter.weights):
            a, b = (t.detach().float().cpu().numpy() for t in adapter.weights[module])
            if arch in INTERLEAVED_QK and module.endswith(("q_proj", "k_proj")):
                b = interleave_heads(b, heads if module.endswith("q_proj") else kv_heads)
            writer.add_tensor(names[module] + ".lora_a", a.astype(dtype))
            writer.add_tensor(names[module] + ".lora_b", b.astype(dtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(partial, out)
    return out


def read_gguf_lora(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The tensors of an adapter file by GGUF name (float32), after checking it says it is a LoRA adapter."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {name: reader.fields[name] for name in (gguf.Keys.General.TYPE, gguf.Keys.Adapter.TYPE)}
    kinds = [bytes(f.parts[f.data[0]]).decode() for f in fields.values()]
    if kinds != ["adapter", "lora"]:
        raise MemoryFormatError(f"{path} is not a GGUF LoRA adapter (general.type, adapter.type = {kinds})")
    return {
        t.name: np.asarray(t.data, dtype=np.float32).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors
    }
