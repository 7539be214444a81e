"""Everything that defines a memory: the :class:`LatentMemory` file format (:mod:`.latent`), its kinds
(:mod:`.kinds`: ``soft_prompt``, ``lora`` in :mod:`.lora`, ``prefix`` in :mod:`.prefix`), ids and the
question rule (:mod:`.ids`), retrieval keys (:mod:`.keys`), the PEFT adapter format (:mod:`.peft`), the
initial soft prompt (:mod:`.init`) and the pure merge math (:mod:`.merge`).

Memory parameterisations (``memory.kind``): what a memory's trained weights are and how they condition
the frozen model.

- ``soft_prompt`` (paper's choice): k vectors inserted into the input embeddings; applied by the
  backends themselves through ``PromptInput.soft_prompt`` (no adapter object).
- ``lora``: a low-rank delta on the attention and MLP projections, added by forward hooks only while the
  memory is applied; the shared model's weights never change.
- ``prefix``: per-layer key/value vectors placed in the KV cache before the prompt (prefix tuning).

``lora`` and ``prefix`` memories travel as a :class:`~elm_memory.memory.kinds.MemoryAdapter` in
``PromptInput.memory``.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, typed; at run time they are imported on first use (below)
    from elm_memory.memory.ids import question_hash
    from elm_memory.memory.kinds import KINDS, SOFT_PROMPT, AppliedMemory, MemoryAdapter, check_kind
    from elm_memory.memory.latent import (
        FORMAT_VERSION,
        MAX_FILE_BYTES,
        MAX_HEADER_BYTES,
        MAX_KEY_KINDS,
        MAX_MERGED,
        MAX_QUESTION_CHARS,
        LatentMemory,
        MemoryMeta,
        TrainingStats,
    )

# Imported lazily so the torch-free modules here (ids, the key builders' names) can be imported without
# torch: the job queue files jobs by question hash, and a config's names are checked before a model loads.
_MODULE_OF = {
    "elm_memory.memory.ids": ("question_hash",),
    "elm_memory.memory.kinds": ("KINDS", "SOFT_PROMPT", "AppliedMemory", "MemoryAdapter", "check_kind"),
    "elm_memory.memory.latent": (
        "FORMAT_VERSION",
        "MAX_FILE_BYTES",
        "MAX_HEADER_BYTES",
        "MAX_KEY_KINDS",
        "MAX_MERGED",
        "MAX_QUESTION_CHARS",
        "LatentMemory",
        "MemoryMeta",
        "TrainingStats",
    ),
}
_WHERE = {name: module for module, names in _MODULE_OF.items() for name in names}

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "MAX_FILE_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_KEY_KINDS",
    "MAX_MERGED",
    "MAX_QUESTION_CHARS",
    "SOFT_PROMPT",
    "AppliedMemory",
    "LatentMemory",
    "MemoryAdapter",
    "MemoryMeta",
    "TrainingStats",
    "check_kind",
    "question_hash",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
