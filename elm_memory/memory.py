"""LatentMemory: one question's experience as a soft prompt, its retrieval keys and metadata.

On disk a memory is ONE safetensors file: tensors ``soft_prompt`` (k x d, float32) and
``key.<kind>`` (1-D), and the metadata as JSON under the header key ``elm_memory``.
safetensors holds no code, so a memory received from someone else is data, never
pickle. Loading validates shape, dtype, finiteness and the metadata; using a memory
with a model checks hidden size and the embedding-table fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError

if TYPE_CHECKING:
    from elm_memory.models.loading import ModelInfo

FORMAT_VERSION = 1
_META_KEY = "elm_memory"


def question_hash(question: str) -> str:
    return hashlib.sha256(question.strip().encode("utf-8")).hexdigest()


@dataclass
class TrainingStats:
    """What happened while the memory was learned (no ground truth involved)."""

    engine: str = "native"
    objective: str = "grpo"
    steps: int = 0
    mean_reward: list[float] = field(default_factory=list)  # per step
    kl: list[float] = field(default_factory=list)  # per step, mean per token
    loss: list[float] = field(default_factory=list)  # per step
    skipped_backward: list[bool] = field(default_factory=list)  # all rewards equal -> no gradient
    majority_answer: str | None = None  # of the last step's group
    majority_share: float = 0.0
    answers: list[list[str | None]] = field(default_factory=list)  # per step, per rollout
    no_consensus: bool = False  # no rollout ever produced an answer
    seconds: float = 0.0
    generation_seconds: float = 0.0
    backward_seconds: float = 0.0
    completion_tokens: int = 0


@dataclass
class MemoryMeta:
    id: str
    namespace: str
    question: str
    question_hash: str
    model_name: str
    hidden_size: int
    model_fingerprint: str
    created_at: float
    num_tokens: int
    config: dict[str, Any] = field(default_factory=dict)
    stats: TrainingStats = field(default_factory=TrainingStats)
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MemoryMeta:
        try:
            raw = json.loads(text)
            stats = TrainingStats(**raw.pop("stats", {}))
            return cls(stats=stats, **raw)
        except (ValueError, TypeError) as exc:
            raise MemoryFormatError(f"memory metadata is malformed: {exc}") from None


@dataclass
class LatentMemory:
    soft_prompt: torch.Tensor  # (k, hidden), float32, on CPU
    meta: MemoryMeta
    keys: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> 1-D float32

    def __post_init__(self) -> None:
        self.soft_prompt = self.soft_prompt.detach().to("cpu", torch.float32).contiguous()
        self.keys = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.keys.items()}
        self.validate()

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def no_consensus(self) -> bool:
        return self.meta.stats.no_consensus

    # -- construction ----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        soft_prompt: torch.Tensor,
        *,
        question: str,
        namespace: str,
        model: ModelInfo,
        config: dict[str, Any] | None = None,
        stats: TrainingStats | None = None,
        memory_id: str | None = None,
    ) -> LatentMemory:
        meta = MemoryMeta(
            id=memory_id or uuid.uuid4().hex,
            namespace=namespace,
            question=question,
            question_hash=question_hash(question),
            model_name=model.name,
            hidden_size=model.hidden_size,
            model_fingerprint=model.fingerprint,
            created_at=time.time(),
            num_tokens=int(soft_prompt.shape[0]),
            config=config or {},
            stats=stats or TrainingStats(),
        )
        return cls(soft_prompt=soft_prompt, meta=meta)

    # -- checks ----------------------------------------------------------------------
    def validate(self) -> None:
        sp = self.soft_prompt
        if sp.dim() != 2 or sp.shape[0] < 1:
            raise MemoryFormatError(f"soft prompt must be (k>=1, hidden), got shape {tuple(sp.shape)}")
        if not torch.isfinite(sp).all():
            raise MemoryFormatError("soft prompt contains NaN or inf")
        if sp.shape[1] != self.meta.hidden_size:
            raise MemoryFormatError(
                f"soft prompt hidden size {sp.shape[1]} disagrees with its metadata ({self.meta.hidden_size})"
            )
        if sp.shape[0] != self.meta.num_tokens:
            raise MemoryFormatError(f"soft prompt has {sp.shape[0]} tokens, metadata says {self.meta.num_tokens}")
        for kind, key in self.keys.items():
            if key.dim() != 1 or not torch.isfinite(key).all():
                raise MemoryFormatError(f"key {kind!r} must be a finite 1-D vector")

    def check_compatible(self, model: ModelInfo) -> None:
        """Refuse a memory made for another model, with a message that says which."""
        if self.meta.hidden_size != model.hidden_size:
            raise IncompatibleMemoryError(
                f"memory {self.id[:8]} was made for {self.meta.model_name} (hidden size {self.meta.hidden_size}); "
                f"the loaded model {model.name} has hidden size {model.hidden_size}"
            )
        if self.meta.model_fingerprint != model.fingerprint:
            raise IncompatibleMemoryError(
                f"memory {self.id[:8]} was made for {self.meta.model_name} (embedding fingerprint "
                f"{self.meta.model_fingerprint}); the loaded model {model.name} has {model.fingerprint}"
            )

    # -- serialisation ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {"soft_prompt": self.soft_prompt, **{f"key.{k}": v for k, v in self.keys.items()}}
        return save(tensors, metadata={_META_KEY: self.meta.to_json()})

    @classmethod
    def from_bytes(cls, data: bytes) -> LatentMemory:
        from safetensors import SafetensorError, safe_open  # noqa: F401
        from safetensors.torch import load

        try:
            tensors = load(data)
            meta_text = _read_metadata(data)
        except Exception as exc:  # safetensors raises several types on junk
            raise MemoryFormatError(f"not a safetensors memory file: {exc}".splitlines()[0]) from None
        return cls._from_parts(tensors, meta_text)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename): a crash leaves the old file or none."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_bytes()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatentMemory:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise MemoryFormatError(f"cannot read memory file {path}: {exc.strerror or exc}") from None
        return cls.from_bytes(data)

    @classmethod
    def _from_parts(cls, tensors: dict[str, torch.Tensor], meta_text: str | None) -> LatentMemory:
        if meta_text is None:
            raise MemoryFormatError("memory file has no elm_memory metadata")
        meta = MemoryMeta.from_json(meta_text)
        if meta.format > FORMAT_VERSION:
            raise MemoryFormatError(f"memory format {meta.format} is newer than this library ({FORMAT_VERSION})")
        if "soft_prompt" not in tensors:
            raise MemoryFormatError("memory file has no soft_prompt tensor")
        sp = tensors.pop("soft_prompt")
        if not sp.is_floating_point():
            raise MemoryFormatError(f"soft prompt must be floating point, got {sp.dtype}")
        keys = {name.removeprefix("key."): t for name, t in tensors.items() if name.startswith("key.")}
        return cls(soft_prompt=sp, meta=meta, keys=keys)


def _read_metadata(data: bytes) -> str | None:
    """The header metadata of a safetensors buffer (8-byte little-endian length + JSON)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return (header.get("__metadata__") or {}).get(_META_KEY)
