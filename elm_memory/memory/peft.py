"""A memory as a PEFT prompt-tuning adapter, and back.

A memory at ``prompt.soft_prompt_position: prefix`` is exactly what PEFT calls prompt tuning:
k trainable vectors placed before every input token. :func:`export_adapter` writes the folder
``PeftModel.from_pretrained(base, folder)`` loads (written here with safetensors and json; peft
itself is not needed):

- ``adapter_config.json``: ``peft_type: PROMPT_TUNING``, ``task_type: CAUSAL_LM``,
  ``num_virtual_tokens: k``, ``token_dim: hidden``, ``num_transformer_submodules: 1``;
- ``adapter_model.safetensors``: one tensor, ``prompt_embeddings`` (k x hidden, float32);
- ``elm_memory.json``: what ELM needs to take it back (memory id, namespace, question, model
  name, hidden size and embedding fingerprint, training statistics); PEFT ignores it.

A ``lora`` memory is exported as a PEFT ``LORA`` adapter (:func:`export_lora_adapter`: ``r``,
``lora_alpha``, ``target_modules``; weights ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``),
which ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` both load; it is not imported back (the
importer reads prompt-tuning folders only). A ``prefix`` memory is refused: its keys are per-layer cache
entries after RoPE, not something PEFT's prefix tuning reproduces exactly.

A ``user_turn`` memory sits after the chat template's user header, which prompt tuning cannot
express: :class:`~elm_memory.errors.AdapterError`. :func:`read_adapter` validates a folder
(sizes, fields, shapes, finiteness) before anything is stored; :func:`check_adapter` compares it
with the configured model and memory shape. Keys are rebuilt by the importer with the
configured key builder (an adapter carries none).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.atomic import write_bytes_atomic
from elm_memory.errors import AdapterError, IncompatibleMemoryError, MemoryFormatError
from elm_memory.memory.latent import MAX_FILE_BYTES, MAX_HEADER_BYTES, LatentMemory, MemoryMeta

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.memory.lora import LoraAdapter
    from elm_memory.models.loading import ModelInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ELM_METADATA = "elm_memory.json"
WEIGHT_KEY = "prompt_embeddings"
ELM_ADAPTER_FORMAT = 1
_MAX_CONFIG_BYTES = 1024 * 1024


def memory_position(memory: LatentMemory, default: str) -> str:
    """Where the memory was trained to sit: its recorded ``soft_prompt_position``, else ``default``."""
    recorded = memory.meta.config.get("soft_prompt_position") if isinstance(memory.meta.config, dict) else None
    return recorded if isinstance(recorded, str) else default


def require_prefix(memory: LatentMemory, position: str) -> None:
    """Refuse a memory that is not used at the ``prefix`` position (prompt tuning cannot express it)."""
    if position != "prefix":
        raise AdapterError(
            f"memory {memory.id[:8]} is used at soft_prompt_position={position!r}; a PEFT prompt-tuning adapter "
            "can only hold a prefix memory (virtual tokens before all input tokens)"
        )


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def export_adapter(memory: LatentMemory, out: str | os.PathLike[str], *, position: str, base_model: str) -> Path:
    """Write ``memory`` as a PEFT prompt-tuning adapter folder ``out`` (created; our three files replaced).

    ``position``: where the memory is used (``prefix`` or ``user_turn``); ``base_model``: written as
    ``base_model_name_or_path`` (what ``AutoPeftModelForCausalLM`` would load). A lora memory is written
    as a LoRA adapter (the position does not apply to it); a prefix memory is refused."""
    if memory.kind == "lora":
        return export_lora_adapter(memory, out, base_model=base_model)
    if memory.kind != "soft_prompt":
        raise AdapterError(
            f"memory {memory.id[:8]} is a {memory.kind} memory; only soft prompts and lora export to PEFT"
        )
    require_prefix(memory, position)
    k, hidden = (int(n) for n in memory.soft_prompt.shape)
    config = {
        "peft_type": "PROMPT_TUNING",
        "task_type": "CAUSAL_LM",
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "num_virtual_tokens": k,
        "token_dim": hidden,
        "num_transformer_submodules": 1,
        "num_attention_heads": None,
        "num_layers": None,
        "modules_to_save": None,
        "prompt_tuning_init": "RANDOM",
        "prompt_tuning_init_text": None,
        "tokenizer_name_or_path": None,
        "tokenizer_kwargs": None,
    }
    elm = {"format": ELM_ADAPTER_FORMAT, "soft_prompt_position": position, "memory": asdict(memory.meta)}
    from safetensors.torch import save

    weights = save({WEIGHT_KEY: memory.soft_prompt.to(torch.float32).contiguous()}, metadata={"format": "pt"})
    return _write_adapter(Path(out), config, weights, elm)


def export_lora_adapter(memory: LatentMemory, out: str | os.PathLike[str], *, base_model: str) -> Path:
    """Write a ``lora`` memory as a PEFT LoRA adapter folder (module doc): what
    ``PeftModel.from_pretrained(base, out)`` and vLLM's ``LoRARequest(name, id, out)`` load."""
    from elm_memory.memory.lora import LoraAdapter

    adapter = memory.adapter()
    assert isinstance(adapter, LoraAdapter)
    return write_lora_adapter(adapter, out, base_model=base_model, elm={"memory": asdict(memory.meta)})


def write_lora_adapter(
    adapter: LoraAdapter, out: str | os.PathLike[str], *, base_model: str, elm: dict[str, Any] | None = None
) -> Path:
    """The PEFT LoRA folder of ``adapter`` (also what the vLLM backend serves a lora prompt from)."""
    from safetensors.torch import save

    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": adapter.target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    tensors = {}
    for name, (a, b) in adapter.weights.items():  # PEFT's saved names: the adapter name ("default") left out
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().to(torch.float32).contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().to(torch.float32).contiguous()
    meta = {"format": ELM_ADAPTER_FORMAT, **(elm or {})}
    return _write_adapter(Path(out), config, save(tensors, metadata={"format": "pt"}), meta)


def _write_adapter(out: Path, config: dict[str, Any], weights: bytes, elm: dict[str, Any]) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(out / ADAPTER_WEIGHTS, weights)
        write_bytes_atomic(out / ELM_METADATA, json.dumps(elm, ensure_ascii=False, indent=1).encode("utf-8"))
        write_bytes_atomic(
            out / ADAPTER_CONFIG, json.dumps(config, indent=2).encode("utf-8")
        )  # last: marks it complete
    except OSError as exc:
        raise AdapterError(f"cannot write the adapter to {out}: {exc.strerror or exc}") from None
    return out


def read_adapter(folder: str | os.PathLike[str]) -> tuple[LatentMemory, str]:
    """The memory (no keys) and its position from an adapter folder that :func:`export_adapter` wrote.

    Raises :class:`AdapterError` naming the file or field that is wrong."""
    folder = Path(folder)
    config = _read_json(folder / ADAPTER_CONFIG, _MAX_CONFIG_BYTES)
    if config.get("peft_type") != "PROMPT_TUNING":
        raise AdapterError(
            f"{folder}: peft_type is {config.get('peft_type')!r}; only PROMPT_TUNING adapters hold a memory"
        )
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise AdapterError(f"{folder}: task_type is {config.get('task_type')!r}, expected CAUSAL_LM")
    if config.get("num_transformer_submodules", 1) not in (None, 1):
        n = config["num_transformer_submodules"]
        raise AdapterError(f"{folder}: num_transformer_submodules is {n!r}, expected 1")
    k, hidden = config.get("num_virtual_tokens"), config.get("token_dim")
    for name, value in (("num_virtual_tokens", k), ("token_dim", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AdapterError(f"{folder}: {name} must be a positive integer, got {value!r}")
    if not (folder / ELM_METADATA).is_file():
        raise AdapterError(
            f"{folder}: no {ELM_METADATA}; ELM imports the adapters it exported (the question is needed to build keys)"
        )
    elm = _read_json(folder / ELM_METADATA, MAX_HEADER_BYTES)
    if not isinstance(elm.get("format"), int) or elm["format"] > ELM_ADAPTER_FORMAT:
        raise AdapterError(f"{folder}: {ELM_METADATA} format {elm.get('format')!r} is not one this version reads")
    position = elm.get("soft_prompt_position", "prefix")
    if position != "prefix":
        raise AdapterError(
            f"{folder}: soft_prompt_position is {position!r}; a prompt-tuning adapter is a prefix memory"
        )
    if not isinstance(elm.get("memory"), dict):
        raise AdapterError(f"{folder}: {ELM_METADATA} has no memory metadata")
    try:
        meta = MemoryMeta.from_json(json.dumps(elm["memory"]))
    except MemoryFormatError as exc:
        raise AdapterError(f"{folder}: {ELM_METADATA}: {exc}") from None
    prompt = _read_weights(folder / ADAPTER_WEIGHTS)
    if tuple(prompt.shape) != (k, hidden):
        raise AdapterError(
            f"{folder}: {WEIGHT_KEY} has shape {tuple(prompt.shape)}, adapter_config.json says "
            f"num_virtual_tokens={k}, token_dim={hidden}"
        )
    if meta.num_tokens != k or meta.hidden_size != hidden:
        raise AdapterError(
            f"{folder}: {ELM_METADATA} says num_tokens={meta.num_tokens}, hidden_size={meta.hidden_size}; "
            f"adapter_config.json says num_virtual_tokens={k}, token_dim={hidden}"
        )
    try:
        memory = LatentMemory(soft_prompt=prompt, meta=meta)
    except MemoryFormatError as exc:
        raise AdapterError(f"{folder}: {exc}") from None
    return memory, position


def check_adapter(memory: LatentMemory, folder: str | os.PathLike[str], cfg: ELMConfig, info: ModelInfo | None) -> None:
    """Refuse an adapter the configured memory shape, prompt position or model (when given) disagree with."""
    k = memory.meta.num_tokens
    if k != cfg.memory.num_tokens:
        raise AdapterError(
            f"{folder}: num_virtual_tokens is {k}, the config's memory.num_tokens is {cfg.memory.num_tokens}"
        )
    if cfg.prompt.soft_prompt_position != "prefix":
        raise AdapterError(
            f"{folder}: a prompt-tuning adapter is a prefix memory; the config's prompt.soft_prompt_position "
            f"is {cfg.prompt.soft_prompt_position!r}"
        )
    if info is None:
        return
    if memory.meta.hidden_size != info.hidden_size:
        raise IncompatibleMemoryError(
            f"{folder}: token_dim is {memory.meta.hidden_size}, the configured model {info.name} has hidden size "
            f"{info.hidden_size}"
        )
    if memory.meta.model_fingerprint != info.fingerprint:
        raise IncompatibleMemoryError(
            f"{folder}: model_fingerprint is {memory.meta.model_fingerprint} ({memory.meta.model_name}), the "
            f"configured model {info.name} has {info.fingerprint}"
        )


# ---- helpers --------------------------------------------------------------------------


def _read_bytes(path: Path, limit: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise AdapterError(f"{path} is {size} bytes (at most {limit})")
        return path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"cannot read {path}: {exc.strerror or exc}") from None


def _read_json(path: Path, limit: int) -> dict[str, Any]:
    try:
        data = json.loads(_read_bytes(path, limit).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise AdapterError(f"{path} is not valid JSON") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    return data


def _read_weights(path: Path) -> torch.Tensor:
    from safetensors.torch import load

    data = _read_bytes(path, MAX_FILE_BYTES)
    header = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    if header > MAX_HEADER_BYTES:
        raise AdapterError(f"{path}: safetensors header is {header} bytes (at most {MAX_HEADER_BYTES})")
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises several types on junk
        raise AdapterError(f"{path} is not a safetensors file: {exc}".splitlines()[0]) from None
    if set(tensors) != {WEIGHT_KEY}:
        raise AdapterError(f"{path} must hold exactly one tensor, {WEIGHT_KEY!r}; found {sorted(tensors)[:4]}")
    prompt = tensors[WEIGHT_KEY]
    if prompt.dim() != 2 or not prompt.is_floating_point():
        raise AdapterError(f"{path}: {WEIGHT_KEY} must be a 2-D float tensor, got {prompt.dtype} {tuple(prompt.shape)}")
    return prompt.to(torch.float32)
