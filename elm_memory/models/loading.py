"""Load the frozen base model and tokenizer named by a :class:`ModelConfig`."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from elm_memory.config import ModelConfig
from elm_memory.errors import ModelNotFoundError
from elm_memory.hardware import Placement, apply_allocator, apply_threads, resolve_device, resolve_placement
from elm_memory.models.fingerprint import embedding_fingerprint
from elm_memory.models.packaged import PACKAGED_PREFIX
from elm_memory.models.prepare import is_prepared, prepare_model, prepared_dir, stored_fingerprint

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


@dataclass(frozen=True)
class ModelInfo:
    """What a memory must match to be usable with a model, plus shape facts for key builders."""

    name: str
    path: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: str
    device: str
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, max_context: int | None = None, **fields: Any) -> ModelInfo:
        """Shape facts from a transformers config (its text part); ``fields`` fill the rest."""
        text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_heads = text_cfg.num_attention_heads
        context = cast(int, max_context or getattr(text_cfg, "max_position_embeddings", 2048))
        return cls(
            model_type=text_cfg.model_type,
            hidden_size=text_cfg.hidden_size,
            num_layers=text_cfg.num_hidden_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(text_cfg, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // n_heads,
            max_context=context,
            **fields,
        )


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, frozen, eval mode
    tokenizer: Any
    info: ModelInfo
    load_seconds: float
    placement: Placement | None = None  # the device/dtype/threads decision and its reasons


def resolve_model_path(name_or_path: str, *, prepare: bool = True) -> str:
    """Map a config string to something ``from_pretrained`` can open offline when possible."""
    if name_or_path.startswith(PACKAGED_PREFIX) or name_or_path.endswith(".gguf"):
        if not is_prepared(name_or_path):
            if not prepare:
                raise ModelNotFoundError(f"{name_or_path} is not prepared; run `elm model prepare {name_or_path}`")
            return str(prepare_model(name_or_path))
        return str(prepared_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return str(path)
    return name_or_path  # hub id; transformers honours HF_HUB_OFFLINE


def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device exists, else ``cpu`` (:func:`elm_memory.hardware.resolve_device`)."""
    return resolve_device(device)


def _prepack(model: Any, placement: Placement) -> Placement:
    """Reorder the frozen linear weights for oneDNN; a placement saying so if this torch cannot."""
    from dataclasses import replace

    from elm_memory.models.prepack import prepack_linears

    if prepack_linears(model):
        return placement
    reason = f"weights plain: this torch build or CPU has no oneDNN packed linear ops in {placement.dtype}"
    return replace(placement, weight_prepack=False, reasons=(*placement.reasons, reason))


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load tokenizer + causal LM, frozen and in eval mode, on the configured device and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    placement = resolve_placement(cfg)
    apply_threads(placement)
    path = resolve_model_path(cfg.name_or_path)
    device = placement.device
    dtype = getattr(torch, _DTYPES[placement.dtype])
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=placement.attn_implementation
        )
    except OSError as exc:
        hint = "" if os.environ.get("HF_HUB_OFFLINE") != "1" else " (HF_HUB_OFFLINE=1 is set)"
        raise ModelNotFoundError(f"cannot load model {cfg.name_or_path!r}{hint}: {exc}".splitlines()[0]) from None
    model.to(device)
    model.eval()
    model.requires_grad_(False)  # the base model is frozen, always
    apply_allocator(placement)  # after loading: the weights' own allocations are left as they were
    if placement.weight_prepack:
        placement = _prepack(model, placement)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fingerprint = stored_fingerprint(path) or embedding_fingerprint(model)
    info = ModelInfo.from_config(
        model.config,
        max_context=cfg.max_context,
        name=cfg.name_or_path,
        path=path,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        dtype=placement.dtype,
        device=device,
        fingerprint=fingerprint,
    )
    logger.info("model %s on %s", cfg.name_or_path, placement.summary())
    return LoadedModel(
        model=model, tokenizer=tokenizer, info=info, load_seconds=time.perf_counter() - t0, placement=placement
    )
