"""Find the stored memory for a new question (paper: top-1 by cosine similarity of keys).

``Retriever`` joins three things that each know one job: a key builder (question or
memory -> vector, with the frozen model), a store (nearest neighbours inside one
namespace) and the loaded model. It also files new memories (``index_memory``), so
keys are always built by the same builder that later queries them.

Gates. A candidate (best first) is passed over when its similarity is below
``min_similarity`` (and so is everything after it), when it has no consensus (no rollout
found an answer), when its training vote was weak (majority share below
``min_majority_share``), when its measured utility is low (``min_utility``, once it has
``min_utility_observations`` judged answers) or when its blob cannot be read.
``retrieve_with_gates`` says which gate did what, as a :class:`RetrievalDecision`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from elm_memory.errors import ConfigError, MemoryFormatError, MemoryKindError, StoreError
from elm_memory.memory import LatentMemory
from elm_memory.memory.keys import KeyBuilder, QuestionIds, memory_inputs, tokenize_question

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.models.loading import LoadedModel
    from elm_memory.store.base import MemoryStoreBase, StoreHit

log = logging.getLogger(__name__)


@dataclass
class Hit:
    """A retrieved memory and its cosine similarity to the question (kv: mean over layers)."""

    memory: LatentMemory
    score: float


#: Why the top-1 memory was or wasn't used (see :class:`RetrievalDecision`).
DecisionKind = Literal[
    "used",
    "empty_pool",
    "below_min_similarity",
    "other_kind",
    "weak_majority",
    "no_consensus",
    "low_utility",
    "unreadable",
]
#: Gates, in the order a candidate meets them.
GATES: tuple[DecisionKind, ...] = (
    "below_min_similarity",
    "other_kind",
    "no_consensus",
    "weak_majority",
    "low_utility",
    "unreadable",
)


@dataclass(frozen=True)
class RetrievalDecision:
    """What happened to the best candidate of one query (top-1; JSON-able via :meth:`to_dict`).

    ``decision``: ``"used"`` when a memory was returned; ``"empty_pool"`` when the namespace
    has no memory of this key kind; otherwise the gate that rejected the best-scoring
    candidate (nothing was returned). ``candidate_id``/``similarity``/``majority_share``:
    the used memory when ``used``, else the best-scoring candidate (all None for
    ``empty_pool``; ``majority_share`` None when the store row does not carry it).
    ``threshold``: the rejecting gate's threshold (``min_similarity``, ``min_majority_share``
    or ``min_utility``); None for the other decisions. ``skipped``: candidates that
    scored higher than the used one (or, when nothing was used, every candidate seen) and
    were passed over; ``skipped_by`` counts them per gate. A ``used`` decision with
    ``skipped > 0`` means a gate turned down a better match. Candidates below
    ``min_similarity`` are counted once: the first one ends the scan.
    """

    decision: DecisionKind
    candidate_id: str | None = None
    similarity: float | None = None
    majority_share: float | None = None
    threshold: float | None = None
    skipped: int = 0
    skipped_by: dict[str, int] = field(default_factory=dict)

    @property
    def used(self) -> bool:
        return self.decision == "used"

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "candidate_id": self.candidate_id,
            "similarity": self.similarity,
            "majority_share": self.majority_share,
            "threshold": self.threshold,
            "skipped": self.skipped,
            "skipped_by": dict(self.skipped_by),
        }


def _record_share(record: Any) -> float | None:
    """The training vote's majority share from an index row (no blob read); None if absent."""
    value = (record.stats or {}).get("majority_share")
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _decide(kept: list[Hit], rejected: list[RetrievalDecision]) -> RetrievalDecision:
    """The top-1 decision from the kept hits and the candidates rejected above the first of them."""
    skipped: dict[str, int] = {}
    for r in rejected:
        skipped[r.decision] = skipped.get(r.decision, 0) + 1
    if kept:
        top = kept[0]
        share = float(top.memory.meta.stats.majority_share)
        return RetrievalDecision("used", top.memory.id, float(top.score), share, None, len(rejected), skipped)
    if not rejected:
        return RetrievalDecision("empty_pool")
    best = rejected[0]
    return RetrievalDecision(
        best.decision, best.candidate_id, best.similarity, best.majority_share, best.threshold, len(rejected), skipped
    )


def _check_share(value: float) -> float:
    """A majority share threshold in [0, 1] (typed error: it usually comes from user config)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"min_majority_share must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_utility(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"min_utility must be a number in [0, 1] or None, got {value!r}")
    return float(value)


class Retriever:
    """Query and index memories of one model with one key kind."""

    def __init__(
        self,
        store: MemoryStoreBase,
        key_builder: KeyBuilder,
        loaded: LoadedModel,
        *,
        record_usage: bool = True,
        min_majority_share: float = 0.0,
        min_utility: float | None = None,
        min_utility_observations: int = 5,
        memory_kind: str | None = None,
    ):
        self.store = store
        # the pool is read as memories of this kind (``memory.kind``); others are passed over (``other_kind``),
        # so e.g. a lora memory is never handed to a soft-prompt caller. None: every kind.
        self.memory_kind = memory_kind
        self.key_builder = key_builder
        self.loaded = loaded
        self.record_usage = record_usage
        # the default for ``retrieve(min_majority_share=None)``: kept here so callers that
        # predate the gate (and pass only min_similarity/skip_no_consensus) still honour the config
        self.min_majority_share = _check_share(min_majority_share)
        self.min_utility = _check_utility(min_utility)
        if (
            isinstance(min_utility_observations, bool)
            or not isinstance(min_utility_observations, int)
            or (min_utility_observations < 1)
        ):
            raise ConfigError(f"min_utility_observations must be an integer >= 1, got {min_utility_observations!r}")
        self.min_utility_observations = min_utility_observations

    @classmethod
    def from_config(cls, cfg: ELMConfig, loaded: LoadedModel, **store_kwargs: Any) -> Retriever:
        """Builder and store picked by name through the registries (``retrieval.key``, ``store.kind``)."""
        from elm_memory.memory.keys import key_builders
        from elm_memory.store.registry import stores

        builder = key_builders.get(cfg.retrieval.key)()
        store = stores.get(cfg.store.kind).from_config(cfg.store, model=loaded.info, **store_kwargs)
        r = cfg.retrieval
        return cls(
            store,
            builder,
            loaded,
            min_majority_share=r.min_majority_share,
            min_utility=getattr(r, "min_utility", None),
            min_utility_observations=getattr(r, "min_utility_observations", 5),
            memory_kind=cfg.memory.kind,
        )

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
        min_majority_share: float | None = None,
    ) -> list[Hit]:
        """The ``k`` most similar usable memories of ``namespace``, best first.

        No-consensus and weak-vote memories are skipped by over-fetching rather than a
        metadata filter, which would make every query slow. A row whose blob is missing or
        corrupt is skipped with a warning (``elm memories check`` repairs it).
        ``min_majority_share=None``: the retriever's own (``retrieval.min_majority_share``).
        """
        return self.retrieve_with_gates(question, namespace, k, min_similarity, skip_no_consensus, min_majority_share)[
            0
        ]

    def retrieve_with_gates(
        self,
        question: str | QuestionIds,
        namespace: str,
        k: int = 1,
        min_similarity: float | None = None,
        skip_no_consensus: bool = True,
        min_majority_share: float | None = None,
    ) -> tuple[list[Hit], RetrievalDecision]:
        """:meth:`retrieve` plus the :class:`RetrievalDecision` for its top-1 (``k < 1``: nothing
        is queried and the decision is ``empty_pool``)."""
        share = self.min_majority_share if min_majority_share is None else _check_share(min_majority_share)
        if k < 1:
            return [], RetrievalDecision("empty_pool")
        vector = self.query_key(question)
        hits, decision = self._search(vector, namespace, k, min_similarity, skip_no_consensus, share)
        if hits and self.record_usage:
            self.store.record_usage(self.kind, namespace, [h.memory.id for h in hits])
        return hits, decision

    def _search(
        self,
        vector: torch.Tensor,
        namespace: str,
        k: int,
        min_similarity: float | None,
        skip_no_consensus: bool,
        min_majority_share: float = 0.0,
    ) -> tuple[list[Hit], RetrievalDecision]:
        gated = skip_no_consensus or min_majority_share > 0.0 or self.min_utility is not None
        fetch = 2 * k + 2 if gated else k
        loaded: dict[str, LatentMemory | None] = {}  # blobs read in an earlier, smaller fetch
        while True:
            raw = self.store.query(self.kind, vector, namespace, k=fetch)
            kept: list[Hit] = []
            rejected: list[RetrievalDecision] = []  # candidates ranked above the first kept one
            for h in raw:
                gate, share, threshold = self._gate(h, loaded, min_similarity, skip_no_consensus, min_majority_share)
                if gate is not None:
                    if not kept:  # only what ranks above the top-1 explains the top-1
                        rejected.append(RetrievalDecision(gate, h.record.id, float(h.score), share, threshold))
                    if gate == "below_min_similarity":
                        return kept, _decide(kept, rejected)  # best-first: nothing below can pass
                    continue
                memory = loaded[h.record.id]
                assert memory is not None  # _gate rejects unreadable blobs
                kept.append(Hit(memory=memory, score=h.score))
                if len(kept) == k:
                    return kept, _decide(kept, rejected)
            if len(raw) < fetch:  # the namespace has no more rows
                return kept, _decide(kept, rejected)
            fetch *= 4

    def _gate(
        self,
        h: StoreHit,
        loaded: dict[str, LatentMemory | None],
        min_similarity: float | None,
        skip_no_consensus: bool,
        min_majority_share: float,
    ) -> tuple[DecisionKind | None, float | None, float | None]:
        """(rejecting gate or None, the candidate's majority share, the gate's threshold).

        Cheap row-metadata gates come first, so a rejected candidate's blob is never read;
        a passing one is loaded into ``loaded``.
        """
        share = _record_share(h.record)
        if min_similarity is not None and h.score < min_similarity:
            return "below_min_similarity", share, float(min_similarity)
        if self.memory_kind is not None and str((h.record.stats or {}).get("memory_kind", "soft_prompt")) != (
            self.memory_kind
        ):
            return "other_kind", share, None
        if skip_no_consensus and h.record.no_consensus:
            return "no_consensus", share, None
        if share is not None and share < min_majority_share:
            return "weak_majority", share, min_majority_share
        if self.min_utility is not None and self._low_utility(h):
            return "low_utility", share, self.min_utility
        if h.record.id not in loaded:
            loaded[h.record.id] = self._load(h)
        memory = loaded[h.record.id]
        if memory is None:
            return "unreadable", share, None
        if self.memory_kind is not None and memory.kind != self.memory_kind:  # a store whose rows lack the kind
            return "other_kind", share, None
        if share is None:  # a store whose rows lack the share: the blob's own stats decide
            share = float(memory.meta.stats.majority_share)
            if share < min_majority_share:
                return "weak_majority", share, min_majority_share
        return None, share, None

    def _low_utility(self, hit: StoreHit) -> bool:
        """Utility below ``min_utility`` after enough judged answers (side-table read, no blob read).
        A store without counters, or one that cannot read them, never rejects: the gate fails open."""
        if self.min_utility is None:
            return False
        try:
            u = self.store.utility_of(hit.record.namespace, [hit.record.id]).get(hit.record.id)
        except StoreError as exc:
            log.warning("utility of memory %s unreadable, not gating it: %s", hit.record.id[:8], exc)
            return False
        if u is None or u.observations < self.min_utility_observations:
            return False
        return u.utility is not None and u.utility < self.min_utility

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
        for m in memories:
            if self.memory_kind is not None and m.kind != self.memory_kind:
                raise MemoryKindError(
                    f"memory {m.id[:8]} is a {m.kind} memory; this retriever files {self.memory_kind} memories"
                )
        sources = memory_inputs(self.loaded, memories, ids, self.kind)
        keys = self.key_builder.memory_keys(self.loaded, sources, ids)
        for m, key in zip(memories, keys, strict=True):
            m.keys[self.kind] = key.detach().to("cpu", torch.float32).contiguous()
            m.validate()
        self.store.put_many(memories)
        return memories
