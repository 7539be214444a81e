"""LatentMemory: one question's experience as trained weights, its retrieval keys and metadata.

On disk a memory is ONE safetensors file: its weights, ``key.<kind>`` tensors (1-D), and the
metadata as JSON under the header key ``elm_memory``. The weights depend on ``meta.kind``
(:mod:`elm_memory.memory`): ``soft_prompt`` (k x d, float32; the default, and the only kind
older versions wrote: such files carry no ``kind`` in their metadata and are byte-identical to
theirs), ``lora.<module>.A`` / ``lora.<module>.B`` (``lora``), or ``prefix.<layer>.key`` /
``prefix.<layer>.value`` (``prefix``); ``meta.adapter`` holds a lora memory's alpha.
safetensors holds no code, so a memory received from someone else is data, never
pickle. Loading validates shape, dtype, finiteness and the metadata; using a memory
with a model checks hidden size and the embedding-table fingerprint.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.atomic import write_bytes_atomic
from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError, MemoryKindError
from elm_memory.memory.ids import question_hash, validate_memory_id
from elm_memory.memory.kinds import LORA, PREFIX, SOFT_PROMPT, MemoryAdapter, check_kind

if TYPE_CHECKING:
    from elm_memory.models.loading import ModelInfo

FORMAT_VERSION = 1
_META_KEY = "elm_memory"
#: Caps on a memory file, checked before it is parsed. A real memory is small (tens of
#: soft-prompt vectors, a few 1-D keys, one question); a file received from someone else
#: must not cost memory, index rows or collections out of proportion to that.
MAX_QUESTION_CHARS = 200_000  # far more than fits any supported model's context
MAX_HEADER_BYTES = 8 * 1024 * 1024  # JSON header: tensor table + metadata (question escaped twice)
#: e.g. 512 tokens x 8192 hidden in float32 is 16 MiB; a rank-16 LoRA on all seven projections is 35 MB for the
#: default 0.5B model (8.8M float32 values), 74 MB for the packaged 1.5B and about 160 MB for a 7B model
MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_KEY_KINDS = 16  # each kind is an index collection per namespace
_KIND_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_MERGED = 10_000  # ids in a merged memory's provenance


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
    # provenance of a merged memory (``elm memories merge``): the ids it replaced and how it was made.
    # Left out of the file when empty, so an unmerged memory's bytes are what older versions wrote.
    merged_from: list[str] = field(default_factory=list)
    merge_strategy: str | None = None
    # the parameterisation (memories/): left out of the file for a soft prompt, so those files are what
    # older versions wrote; ``adapter`` holds a kind's own settings (lora: alpha), empty for the others
    kind: str = SOFT_PROMPT
    adapter: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        raw = asdict(self)
        if not self.merged_from and self.merge_strategy is None:
            del raw["merged_from"], raw["merge_strategy"]
        if self.kind == SOFT_PROMPT and not self.adapter:
            del raw["kind"], raw["adapter"]
        return json.dumps(raw, ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MemoryMeta:
        try:
            raw = json.loads(text)
            stats = TrainingStats(**raw.pop("stats", {}))
            meta = cls(stats=stats, **raw)
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:  # RecursionError: deep nesting
            raise MemoryFormatError(f"memory metadata is malformed: {exc}") from None
        meta.validate()  # header-only readers (the store's check) see the same rules as a full load
        return meta

    def validate(self) -> None:
        """What a received file could abuse: the id (it names export files), the question's length,
        the shape facts, and the types the index rows are built from."""
        validate_memory_id(self.id)
        if not isinstance(self.question, str):
            raise MemoryFormatError(f"memory {self.id[:8]}: question must be text")
        if len(self.question) > MAX_QUESTION_CHARS:
            raise MemoryFormatError(
                f"memory {self.id[:8]}: question too long ({len(self.question)} characters, "
                f"at most {MAX_QUESTION_CHARS})"
            )
        check_kind(self.kind)
        if not isinstance(self.adapter, dict) or len(json.dumps(self.adapter, default=str)) > 4096:
            raise MemoryFormatError(f"memory {self.id[:8]}: adapter settings must be a small mapping")
        # a lora memory adds no token to the prompt: num_tokens 0
        for name, least in (("hidden_size", 1), ("num_tokens", 0 if self.kind == LORA else 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MemoryFormatError(f"memory {self.id[:8]}: {name} must be an integer >= {least}, got {value!r}")
        # the index rows are built from these after the blob is written: a wrong type must fail here
        s = self.stats
        checks = {
            "namespace": isinstance(self.namespace, str),
            # both are shown in the messages of a model mismatch, which must stay one line
            "model_name": isinstance(self.model_name, str) and self.model_name.isprintable(),
            "model_fingerprint": isinstance(self.model_fingerprint, str) and self.model_fingerprint.isprintable(),
            "question_hash": isinstance(self.question_hash, str),
            "format": isinstance(self.format, int) and not isinstance(self.format, bool),
            "created_at": _is_number(self.created_at),
            "stats.engine": isinstance(s.engine, str),
            "stats.objective": isinstance(s.objective, str),
            "stats.steps": isinstance(s.steps, numbers.Integral),
            "stats.seconds": _is_number(s.seconds),
            "stats.majority_share": _is_number(s.majority_share),
            "stats.mean_reward": isinstance(s.mean_reward, list) and all(map(_is_number, s.mean_reward)),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise MemoryFormatError(f"memory {self.id[:8]}: metadata field {bad[0]} has the wrong type or value")
        self._validate_provenance()

    def _validate_provenance(self) -> None:
        """``merged_from``: distinct valid memory ids, not this one, at most ``MAX_MERGED``; a strategy
        name with them (and neither without the other)."""
        ids, strategy = self.merged_from, self.merge_strategy
        if not isinstance(ids, list) or len(ids) > MAX_MERGED:
            raise MemoryFormatError(f"memory {self.id[:8]}: merged_from must be a list of at most {MAX_MERGED} ids")
        for mid in ids:
            if not isinstance(mid, str):
                raise MemoryFormatError(f"memory {self.id[:8]}: merged_from holds a non-text id")
            validate_memory_id(mid)
        if len(set(ids)) != len(ids) or self.id in ids:
            raise MemoryFormatError(f"memory {self.id[:8]}: merged_from repeats an id or names the memory itself")
        named = isinstance(strategy, str) and bool(_KIND_RE.fullmatch(strategy))
        if strategy is not None and not named:
            raise MemoryFormatError(f"memory {self.id[:8]}: merge_strategy must be a short name")
        if bool(ids) != (strategy is not None):
            raise MemoryFormatError(f"memory {self.id[:8]}: merged_from and merge_strategy go together")


@dataclass(init=False, eq=False)
class LatentMemory:
    """A memory's weights (``params``, by stored tensor name), its keys and metadata.

    ``soft_prompt`` is the soft-prompt kind's one tensor; asking a ``lora`` or ``prefix`` memory for it
    raises :class:`MemoryKindError`, so such a memory can never be fed to a model as a soft prompt.
    :meth:`adapter` gives those kinds' weights as a :class:`~elm_memory.memory.kinds.MemoryAdapter`.
    """

    meta: MemoryMeta
    keys: dict[str, torch.Tensor]  # key kind -> 1-D float32
    params: dict[str, torch.Tensor]  # float32, CPU; {"soft_prompt": (k, hidden)} or lora.* / prefix.* tensors

    def __init__(
        self,
        soft_prompt: torch.Tensor | None = None,
        *,
        meta: MemoryMeta,
        keys: dict[str, torch.Tensor] | None = None,
        params: dict[str, torch.Tensor] | None = None,
    ):
        if (soft_prompt is None) == (params is None):
            raise TypeError("LatentMemory takes a soft_prompt or params, not both")
        weights = {"soft_prompt": soft_prompt} if soft_prompt is not None else dict(params or {})
        self.meta = meta
        self.params = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in weights.items()}
        self.keys = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in (keys or {}).items()}
        self.validate()

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def kind(self) -> str:
        return self.meta.kind

    @property
    def no_consensus(self) -> bool:
        return self.meta.stats.no_consensus

    @property
    def soft_prompt(self) -> torch.Tensor:
        """(k, hidden): only a soft-prompt memory has one."""
        if self.kind != SOFT_PROMPT:
            raise MemoryKindError(
                f"memory {self.id[:8]} is a {self.kind} memory, not a soft prompt: apply it through its adapter "
                "(PromptInput.memory), never as input embeddings"
            )
        return self.params["soft_prompt"]

    def adapter(self) -> MemoryAdapter:
        """The weights of a ``lora`` or ``prefix`` memory, ready to apply (:mod:`elm_memory.memory`)."""
        from elm_memory.memory.lora import LoraAdapter
        from elm_memory.memory.prefix import PrefixAdapter

        if self.kind == LORA:
            return LoraAdapter.from_tensors(self.params, alpha=self.meta.adapter.get("alpha", 0))
        if self.kind == PREFIX:
            return PrefixAdapter.from_tensors(self.params)
        raise MemoryKindError(f"memory {self.id[:8]} is a soft prompt: it goes in PromptInput.soft_prompt")

    @property
    def num_parameters(self) -> int:
        """Trainable values the memory holds (its weights, not its keys)."""
        return sum(t.numel() for t in self.params.values())

    # -- construction ----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        soft_prompt: torch.Tensor | None = None,
        *,
        question: str,
        namespace: str,
        model: ModelInfo,
        config: dict[str, Any] | None = None,
        stats: TrainingStats | None = None,
        memory_id: str | None = None,
        adapter: MemoryAdapter | None = None,
    ) -> LatentMemory:
        """A new memory of ``soft_prompt`` or of a lora/prefix ``adapter`` (exactly one of them)."""
        if (soft_prompt is None) == (adapter is None):
            raise TypeError("LatentMemory.create takes a soft_prompt or an adapter, not both")
        kind, settings, num_tokens = SOFT_PROMPT, {}, 0
        if soft_prompt is not None:
            num_tokens = int(soft_prompt.shape[0])
        else:
            assert adapter is not None
            kind = adapter.kind
            settings = {"alpha": adapter.alpha} if kind == LORA else {}  # type: ignore[attr-defined]
            num_tokens = adapter.num_tokens if kind == PREFIX else 0  # type: ignore[attr-defined]
        meta = MemoryMeta(
            id=memory_id or uuid.uuid4().hex,
            namespace=namespace,
            question=question,
            question_hash=question_hash(question),
            model_name=model.name,
            hidden_size=model.hidden_size,
            model_fingerprint=model.fingerprint,
            created_at=time.time(),
            num_tokens=num_tokens,
            config=config or {},
            stats=stats or TrainingStats(),
            kind=kind,
            adapter=settings,
        )
        if adapter is not None:
            return cls(meta=meta, params=adapter.tensors())
        return cls(soft_prompt=soft_prompt, meta=meta)

    # -- checks ----------------------------------------------------------------------
    def validate(self) -> None:
        self.meta.validate()
        if self.kind == SOFT_PROMPT:
            self._validate_soft_prompt()
        else:
            self._validate_adapter()
        if len(self.keys) > MAX_KEY_KINDS:
            raise MemoryFormatError(f"memory has {len(self.keys)} key kinds (at most {MAX_KEY_KINDS})")
        for kind, key in self.keys.items():
            if not _KIND_RE.fullmatch(kind):
                raise MemoryFormatError(f"invalid key kind {kind[:40]!r}: use 1-64 of [A-Za-z0-9_.-]")
            if key.dim() != 1 or key.numel() < 1 or not torch.isfinite(key).all():
                raise MemoryFormatError(f"key {kind!r} must be a finite, non-empty 1-D vector")

    def _validate_soft_prompt(self) -> None:
        if set(self.params) != {"soft_prompt"}:
            raise MemoryFormatError("a soft_prompt memory holds exactly one weight tensor, soft_prompt")
        sp = self.params["soft_prompt"]
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

    def _validate_adapter(self) -> None:
        """Names, pairing, shapes and finiteness (the adapter classes check them), and the metadata's facts."""
        adapter = self.adapter()
        num_tokens = getattr(adapter, "num_tokens", 0)
        if num_tokens != self.meta.num_tokens:
            raise MemoryFormatError(f"{self.kind} memory has {num_tokens} tokens, metadata says {self.meta.num_tokens}")
        if self.kind == LORA:
            # every lora module reads or writes the hidden state; a q/gate/up input or o/down output of
            # another width means another model
            for name, (a, b) in adapter.weights.items():  # type: ignore[attr-defined]
                short = name.rsplit(".", 1)[-1]
                width = b.shape[0] if short in ("o_proj", "down_proj") else a.shape[1]
                if short in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj") and (
                    width != self.meta.hidden_size
                ):
                    raise MemoryFormatError(
                        f"lora {name} has width {width}; the memory's hidden size is {self.meta.hidden_size}"
                    )

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
        if self.kind == PREFIX:
            self.adapter().check_info(model)  # type: ignore[attr-defined]
        elif self.kind == LORA and self.adapter().max_layer() >= model.num_layers:  # type: ignore[attr-defined]
            raise IncompatibleMemoryError(
                f"lora memory {self.id[:8]} names layers beyond the {model.num_layers} of {model.name}"
            )

    # -- serialisation ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {**self.params, **{f"key.{k}": v for k, v in self.keys.items()}}
        return save(tensors, metadata={_META_KEY: self.meta.to_json()})

    @classmethod
    def from_bytes(cls, data: bytes) -> LatentMemory:
        from safetensors import SafetensorError, safe_open  # noqa: F401
        from safetensors.torch import load

        _check_size(data)
        try:
            tensors = load(data)
            meta_text = _read_metadata(data)
        except Exception as exc:  # safetensors raises several types on junk
            raise MemoryFormatError(f"not a safetensors memory file: {exc}".splitlines()[0]) from None
        return cls._from_parts(tensors, meta_text)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename): a crash leaves the old file or none."""
        return write_bytes_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatentMemory:
        try:
            size = Path(path).stat().st_size
            if size > MAX_FILE_BYTES:  # refuse before reading it into memory
                raise MemoryFormatError(f"memory file {path} is {size} bytes (at most {MAX_FILE_BYTES})")
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
        keys = {name.removeprefix("key."): t for name, t in tensors.items() if name.startswith("key.")}
        if meta.kind == SOFT_PROMPT:  # as format 1 always read it (other tensors are ignored)
            if "soft_prompt" not in tensors:
                raise MemoryFormatError("memory file has no soft_prompt tensor")
            sp = tensors.pop("soft_prompt")
            if not sp.is_floating_point():
                raise MemoryFormatError(f"soft prompt must be floating point, got {sp.dtype}")
            return cls(soft_prompt=sp, meta=meta, keys=keys)
        weights = {name: t for name, t in tensors.items() if not name.startswith("key.")}
        for name, t in weights.items():
            if not t.is_floating_point():
                raise MemoryFormatError(f"memory tensor {name[:80]} must be floating point, got {t.dtype}")
        return cls(meta=meta, keys=keys, params=weights)


def _is_number(value: Any) -> bool:
    """A finite real that ``float()`` can hold: index rows are built with ``float()`` after the blob is written."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_size(data: bytes) -> None:
    """Refuse an oversized file or header before safetensors parses it."""
    if len(data) > MAX_FILE_BYTES:
        raise MemoryFormatError(f"memory file is {len(data)} bytes (at most {MAX_FILE_BYTES})")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise MemoryFormatError(f"memory file header is {n} bytes (at most {MAX_HEADER_BYTES})")


def _read_metadata(data: bytes) -> str | None:
    """The header metadata of a safetensors buffer (8-byte little-endian length + JSON)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return (header.get("__metadata__") or {}).get(_META_KEY)
