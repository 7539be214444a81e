"""LoRA memories on the vLLM backends, and the kinds they cannot serve.

vLLM serves LoRA through its own adapter support (documented API: ``LLM(..., enable_lora=True,
max_lora_rank=r)`` and ``llm.generate(prompts, params, lora_request=[LoRARequest(name, int_id, path)
or None per prompt])``). A prompt's lora memory is written once as a PEFT LoRA folder
(:func:`~elm_memory.memory.peft.write_lora_adapter`, the format vLLM loads) under a temporary
directory, named by the weights' digest, and gets a stable integer id: a memory changed by a GRPO
step is a new adapter (vLLM caches adapters by id, so an id must never be reused for other weights).

vLLM takes no per-layer key/value input, so a ``prefix`` memory cannot be served: :func:`check_kind`
refuses it with a :class:`~elm_memory.errors.ConfigError` when the backend is built and when a
prompt carries one. Untested here: vLLM is not installed in the default environment.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elm_memory.errors import ConfigError

if TYPE_CHECKING:
    from elm_memory.memory.kinds import MemoryAdapter


def check_kind(kind: str, backend: str, *, lora: bool) -> None:
    """Refuse a memory kind backend ``backend`` cannot apply (``lora``: whether it serves LoRA at all)."""
    if kind == "prefix":
        raise ConfigError(
            f"backend '{backend}' cannot apply a prefix memory (vLLM has no per-layer key/value input); "
            "use backend.name=hf with memory.kind=prefix"
        )
    if kind == "lora" and not lora:
        raise ConfigError(
            f"backend '{backend}' does not serve lora memories; use backend.name=hf or vllm "
            "(started with memory.kind=lora)"
        )


class LoraRequests:
    """One ``vllm.lora.request.LoRARequest`` per distinct lora memory (by weights digest)."""

    def __init__(self, base_model: str, max_rank: int):
        self.base_model = base_model
        self.max_rank = max_rank
        self._dir = Path(tempfile.mkdtemp(prefix="elm-vllm-lora-"))
        self._requests: dict[str, Any] = {}

    def request(self, memory: MemoryAdapter) -> Any:
        from vllm.lora.request import LoRARequest

        from elm_memory.memory.lora import LoraAdapter
        from elm_memory.memory.peft import write_lora_adapter

        check_kind(memory.kind, "vllm", lora=True)
        assert isinstance(memory, LoraAdapter)
        if memory.rank > self.max_rank:
            raise ConfigError(f"lora memory of rank {memory.rank} exceeds the engine's max_lora_rank {self.max_rank}")
        digest = memory.digest()
        found = self._requests.get(digest)
        if found is None:
            folder = write_lora_adapter(memory, self._dir / digest[:32], base_model=self.base_model)
            # ids start at 1 (vLLM treats 0 as "no adapter") and are never reused
            found = LoRARequest(f"elm-{digest[:12]}", len(self._requests) + 1, str(folder))
            self._requests[digest] = found
        return found

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
