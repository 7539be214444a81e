"""Find the stored memory for a new question (paper: top-1 by cosine similarity of keys).

``Retriever`` joins three things that each know one job: a key builder (question or
memory -> vector, with the frozen model), a store (nearest neighbours inside one
namespace) and the loaded model. It also files new memories (``index_memory``), so
keys are always built by the same builder that later queries them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elm_memory.errors import MemoryFormatError, StoreError
from elm_memory.memory import LatentMemory
from elm_memory.models.prompting import validate_question
from elm_memory.retrieval.keys import KeyBuilder, QuestionIds

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.models.loading import LoadedModel
    from elm_memory.store.base import MemoryStore, StoreHit

log = logging.getLogger(__name__)


@dataclass
class Hit:
    """A retrieved memory and its cosine similarity to the question (kv: mean over layers)."""

    memory: LatentMemory
    score: float


def tokenize_question(tokenizer: Any, question: Any) -> list[int]:
    """Key tokens of a question: its own text, no template or special tokens (see keys.py)."""
    text = validate_question(question)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Retriever:
    """Query and index memories of one model with one key kind."""

    def __init__(self, store: MemoryStore, key_builder: KeyBuilder, loaded: LoadedModel, *, record_usage: bool = True):
        self.store = store
        self.key_builder = key_builder
        self.loaded = loaded
        self.record_usage = record_usage

    @classmethod
    def from_config(cls, cfg: ELMConfig, loaded: LoadedModel, **store_kwargs: Any) -> Retriever:
        """Builder and store picked by name through the registries (``retrieval.key``, ``store.kind``)."""
        from elm_memory.registry import key_builders, stores

        builder = key_builders.get(cfg.retrieval.key)()
        store = stores.get(cfg.store.kind).from_config(cfg.store, model=loaded.info, **store_kwargs)
        return cls(store, builder, loaded)

    @property
    def kind(self) -> str:
        return self.key_builder.kind

    def question_ids(self, question: str | QuestionIds) -> QuestionIds:
        if isinstance(question, (str, bytes, bytearray)):
            return tokenize_question(self.loaded.tokenizer, question)
        return question

    def query_key(self, question: str | QuestionIds) -> torch.Tensor:
        return self.key_builder.query_key(self.loaded, self.question_ids(question))

    # ---- retrieval --------------------------------------------------------------------
    def retrieve(
        self,
        question: str | QuestionIds,
        namespace: str,
        k: int = 1,
        min_similarity: float | None = None,
        skip_no_consensus: bool = True,
    ) -> list[Hit]:
        """The ``k`` most similar usable memories of ``namespace``, best first.

        No-consensus memories (no rollout found an answer) are skipped by over-fetching
        rather than a metadata filter, which would make every query slow. A row whose blob
        is missing or corrupt is skipped with a warning (``elm memories check`` repairs it).
        """
        if k < 1:
            return []
        vector = self.query_key(question)
        hits = self._search(vector, namespace, k, min_similarity, skip_no_consensus)
        if hits and self.record_usage:
            self.store.record_usage(self.kind, namespace, [h.memory.id for h in hits])
        return hits

    def _search(
        self, vector: torch.Tensor, namespace: str, k: int, min_similarity: float | None, skip_no_consensus: bool
    ) -> list[Hit]:
        fetch = k if not skip_no_consensus else 2 * k + 2
        while True:
            raw = self.store.query(self.kind, vector, namespace, k=fetch)
            kept: list[Hit] = []
            for h in raw:
                if min_similarity is not None and h.score < min_similarity:
                    return kept  # best-first: nothing below can pass
                if skip_no_consensus and h.record.no_consensus:
                    continue
                memory = self._load(h)
                if memory is not None:
                    kept.append(Hit(memory=memory, score=h.score))
                    if len(kept) == k:
                        return kept
            if len(raw) < fetch:  # the namespace has no more rows
                return kept
            fetch *= 4

    def _load(self, hit: StoreHit) -> LatentMemory | None:
        try:
            return self.store.load(hit.record)
        except (StoreError, MemoryFormatError) as exc:
            log.warning("skipping memory %s: %s", hit.record.id[:8], exc)
            return None

    # ---- indexing ---------------------------------------------------------------------
    def index_memory(self, memory: LatentMemory, question_ids: QuestionIds | None = None) -> LatentMemory:
        """Fill ``memory.keys[kind]`` and put the memory in the store."""
        return self.index_memories([memory], None if question_ids is None else [question_ids])[0]

    def index_memories(
        self, memories: Sequence[LatentMemory], question_ids: Sequence[QuestionIds] | None = None
    ) -> list[LatentMemory]:
        """Batched ``index_memory``: one key-builder call (one forward for ``kv``), one store write."""
        memories = list(memories)
        for m in memories:
            m.check_compatible(self.loaded.info)
        ids = (
            [self.question_ids(q) for q in question_ids]
            if question_ids is not None
            else [tokenize_question(self.loaded.tokenizer, m.meta.question) for m in memories]
        )
        keys = self.key_builder.memory_keys(self.loaded, [m.soft_prompt for m in memories], ids)
        for m, key in zip(memories, keys, strict=True):
            m.keys[self.kind] = key.detach().to("cpu", torch.float32).contiguous()
            m.validate()
        self.store.put_many(memories)
        return memories
