"""ELM's memory pool as a LangGraph ``BaseStore``: browse, search and delete memories the way LangGraph and
LangMem code (and LangGraph Studio) manage a store, while they stay where ELM keeps them (Chroma rows and
safetensors blobs; nothing is copied)::

    store = langgraph_store(elm)                      # opens elm.config's store; loads no model
    graph = builder.compile(store=store)              # the parent's nodes read runtime.store / get_store()
    store.search(("user-ada",), filter={"no_consensus": False}, query="apples")

What each operation does:

- **Items.** ``key`` is the memory id; ``value`` is the memory's metadata from the index rows and the
  utility table (:func:`memory_value`), never its tensors, so no blob is opened.
- **Namespaces.** An ELM namespace is text; a LangGraph namespace is a tuple of labels without ``.``. The
  mapping (:func:`namespace_path`, :func:`elm_namespace`) splits on ``/`` (``"team/ada"`` <->
  ``("team", "ada")``, ``"user-ada"`` <-> ``("user-ada",)``) and writes ``%`` and ``.`` inside a label as
  ``%25`` and ``%2E``; a namespace with an empty part (``"a//b"``) stays one label with ``/`` as ``%2F``.
  Each ELM namespace has exactly one tuple; any other spelling is refused with the right one named.
- **search** reads the rows of the namespaces under the prefix (like ``elm memories list``), keeps those
  whose value matches ``filter`` (exact values, nested dicts, ``$eq $ne $gt $gte $lt $lte``) and, with a
  ``query``, ranks them: by cosine similarity of ELM's own retrieval keys when the store was built with
  the ELM's retriever (``semantic_search=True``: the model the ELM answers with, loaded once), else by the
  share of the query's words found in the stored question (its first 200 characters, what the index
  keeps). Without a query, oldest first, as ``elm memories list``. Browsing never counts as a retrieval.
- **delete** (and ``put(..., None)``) is the store's journalled delete (rows, blob, counters; ``elm
  memories delete``), then checked: rows, blob and counters must be gone, else :class:`StoreError`.
  Deleting a memory that is not there does nothing, as for any ``BaseStore``.
- **put** of a value is refused (:class:`MemoryWriteRefusedError`): memories are learned, not written.

The ELM graph itself keeps its memories in this store only; writing them into another ``BaseStore`` a
user compiles with is not supported.
"""

from __future__ import annotations

import asyncio
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    validate_op_namespace,
)

from elm_memory.errors import (
    ConfigError,
    InvalidNamespaceError,
    InvalidStoreQueryError,
    MemoryNotFoundError,
    MemoryWriteRefusedError,
    StoreError,
)
from elm_memory.memory.ids import question_hash, validate_memory_id, validate_namespace
from elm_memory.store.utility import shown_counters

if TYPE_CHECKING:
    import torch

    from elm_memory.config import ELMConfig
    from elm_memory.elm import ELM
    from elm_memory.store.base import MemoryRecord, MemoryStoreBase
    from elm_memory.store.utility import Utility

__all__ = ["ELMStore", "elm_namespace", "langgraph_store", "memory_value", "namespace_path"]

# ---- namespaces -------------------------------------------------------------------------------
_SEPARATOR = "/"
_ESCAPES = {"%": "%25", ".": "%2E"}  # "." is the one character LangGraph refuses in a label (NUL is not printable)
_UNESCAPE = re.compile("%(25|2E|2F)")
_UNESCAPED = {"25": "%", "2E": ".", "2F": "/"}


def _label(part: str) -> str:
    return "".join(_ESCAPES.get(ch, ch) for ch in part)


def namespace_path(namespace: str) -> tuple[str, ...]:
    """The LangGraph namespace (tuple of labels) of an ELM namespace: its ``/``-separated parts."""
    parts = namespace.split(_SEPARATOR)
    if all(parts):
        return tuple(_label(part) for part in parts)
    return (_label(namespace).replace(_SEPARATOR, "%2F"),)  # an empty part cannot be a label


def elm_namespace(path: Sequence[str]) -> str:
    """The ELM namespace a LangGraph namespace names (:class:`InvalidNamespaceError` if none, or if the
    namespace is spelt another way than :func:`namespace_path` writes it)."""
    path = tuple(path)
    if not all(isinstance(label, str) for label in path):
        raise InvalidNamespaceError(f"namespace labels must be text, got {path!r}")
    joined = _SEPARATOR.join(path)
    namespace = validate_namespace(_UNESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], joined))
    if namespace_path(namespace) != path:
        raise InvalidNamespaceError(
            f"namespace {path!r} is ELM namespace {namespace!r}: write it {namespace_path(namespace)!r}"
        )
    return namespace


def _matches_condition(path: tuple[str, ...], condition: MatchCondition) -> bool:
    wanted = tuple(condition.path)
    if len(wanted) > len(path):
        return False
    if condition.match_type == "prefix":
        window = path[: len(wanted)]
    elif condition.match_type == "suffix":
        window = path[len(path) - len(wanted) :]
    else:
        raise InvalidStoreQueryError(f"namespace match type must be prefix or suffix, got {condition.match_type!r}")
    return all(w in ("*", label) for w, label in zip(wanted, window, strict=True))


# ---- values -------------------------------------------------------------------------------------
def memory_value(record: MemoryRecord, utility: Utility | None) -> dict[str, Any]:
    """An item's value: what the index and the utility table know about a memory (JSON-able, no tensor)."""
    stats = {k: v for k, v in record.stats.items() if k != "memory_kind"}
    return {
        "question": record.question,
        # the index keeps the question's first 200 characters; the full text is in the blob (`elm memories show`)
        "question_truncated": question_hash(record.question) != record.question_hash,
        "namespace": record.namespace,
        "memory_kind": str(record.stats.get("memory_kind", "soft_prompt")),
        "key_kinds": list(record.kinds),
        "model_fingerprint": record.model_fingerprint,
        "created_at": record.created_at,
        "usage": record.usage,
        "last_used_at": record.last_used_at,
        "no_consensus": record.no_consensus,
        "stats": stats,
        "utility": shown_counters(utility),
        "blob": record.blob,
    }


def _timestamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


# ---- filters ------------------------------------------------------------------------------------
_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": operator.gt,
    "$gte": operator.ge,
    "$lt": operator.lt,
    "$lte": operator.le,
}
_OPERATORS = ("$eq", "$ne", *_ORDER)


def _check_filter(conditions: Mapping[str, Any], where: str = "") -> None:
    """Refuse an unknown operator before any row is read (a typo must not read as 'no match')."""
    for name, wanted in conditions.items():
        field = f"{where}{name}"
        if name.startswith("$"):
            raise InvalidStoreQueryError(f"filter operator {name!r} needs a field: {{'field': {{{name!r}: ...}}}}")
        if isinstance(wanted, Mapping):
            ops = [k for k in wanted if str(k).startswith("$")]
            unknown = [k for k in ops if k not in _OPERATORS]
            if unknown:
                raise InvalidStoreQueryError(
                    f"unknown filter operator {unknown[0]!r} on {field!r}; use {', '.join(_OPERATORS)}"
                )
            if ops and len(ops) != len(wanted):
                raise InvalidStoreQueryError(f"filter on {field!r} mixes operators and fields")
            if not ops:
                _check_filter(wanted, f"{field}.")


def _same(actual: Any, wanted: Any) -> bool:
    if isinstance(actual, bool) != isinstance(wanted, bool):  # True is not 1 here
        return False
    if isinstance(wanted, tuple):
        wanted = list(wanted)
    return bool(actual == wanted)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _compare(actual: Any, op: str, operand: Any, field: str) -> bool:
    if op == "$eq":
        return _same(actual, operand)
    if op == "$ne":
        return not _same(actual, operand)
    if actual is None:  # a ratio never measured (utility, mean_similarity) orders with nothing
        return False
    if (_number(actual) and _number(operand)) or (isinstance(actual, str) and isinstance(operand, str)):
        return _ORDER[op](actual, operand)
    raise InvalidStoreQueryError(f"{field!r} holds {type(actual).__name__}; it does not compare with {operand!r}")


def _matches(value: Mapping[str, Any], conditions: Mapping[str, Any], where: str = "") -> bool:
    for name, wanted in conditions.items():
        actual = value.get(name)
        if isinstance(wanted, Mapping) and any(str(k).startswith("$") for k in wanted):
            if not all(_compare(actual, op, operand, f"{where}{name}") for op, operand in wanted.items()):
                return False
        elif isinstance(wanted, Mapping):
            if not (isinstance(actual, Mapping) and _matches(actual, wanted, f"{where}{name}.")):
                return False
        elif not _same(actual, wanted):
            return False
    return True


_WORD = re.compile(r"\w+")


def _word_share(query: str, question: str) -> float:
    """The share of the query's words that the question holds (case-insensitive)."""
    wanted = set(_WORD.findall(query.lower()))
    return len(wanted & set(_WORD.findall(question.lower()))) / len(wanted) if wanted else 0.0


# ---- the store ----------------------------------------------------------------------------------
class QueryKeys(Protocol):
    """What semantic search needs of ELM's retriever (:class:`~elm_memory.retrieval.retriever.Retriever`)."""

    store: MemoryStoreBase

    @property
    def kind(self) -> str: ...

    def query_key(self, question: str) -> torch.Tensor: ...


class ELMStore(BaseStore):
    """A LangGraph ``BaseStore`` over an ELM memory store (see the module docstring for each operation).

    ``retriever``: the ELM's retriever (bound to the same store), for semantic ``search(query=...)``;
    without it a query ranks by the words of the stored question.
    """

    def __init__(self, store: MemoryStoreBase, *, retriever: QueryKeys | None = None):
        if retriever is not None and retriever.store is not store:
            raise ConfigError("the retriever searches another memory store than the one given")
        self.store = store
        self.retriever = retriever

    @classmethod
    def from_config(cls, config: ELMConfig) -> ELMStore:
        """The configured store, opened without a model (every model's memories), as ``elm memories`` does."""
        from elm_memory.store.registry import stores

        if config.store.kind == "none":
            raise ConfigError("store.kind is 'none': there is no memory store to open")
        return cls(stores.get(config.store.kind).from_config(config.store))

    @property
    def semantic_search(self) -> bool:
        return self.retriever is not None

    # ---- BaseStore ------------------------------------------------------------------------------
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run the operations in order, after checking all of them: a refused one runs nothing."""
        ops = list(ops)
        for op in ops:
            validate_op_namespace(op)
            if isinstance(op, PutOp) and op.value is not None:
                raise MemoryWriteRefusedError(
                    f"cannot put a value at {op.namespace!r}/{op.key!r}: ELM memories are learned (elm.learn, "
                    "or the graph's learn step), not written; put(namespace, key, None) deletes one"
                )
            if isinstance(op, SearchOp):
                if op.limit < 0 or op.offset < 0:
                    raise InvalidStoreQueryError(f"limit and offset must be >= 0, got {op.limit} and {op.offset}")
                _check_filter(op.filter or {})
        results: list[Result] = []
        for op in ops:
            if isinstance(op, GetOp):
                results.append(self._get(op))
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            elif isinstance(op, PutOp):
                self._delete(elm_namespace(op.namespace), validate_memory_id(op.key))
                results.append(None)
            else:
                raise InvalidStoreQueryError(f"unknown store operation {type(op).__name__}")
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` in a worker thread: Chroma and SQLite calls block, the event loop must not."""
        return await asyncio.to_thread(self.batch, list(ops))

    # ---- operations -------------------------------------------------------------------------------
    def _get(self, op: GetOp) -> Item | None:
        namespace, memory_id = elm_namespace(op.namespace), validate_memory_id(op.key)
        try:
            record = self.store.record(memory_id, namespace)
        except MemoryNotFoundError:
            return None
        value = memory_value(record, self.store.utility_of(namespace, [memory_id]).get(memory_id))
        when = _timestamp(record.created_at)
        return Item(value=value, key=record.id, namespace=tuple(op.namespace), created_at=when, updated_at=when)

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        # a namespace whose memories were all deleted keeps its (empty) collections until `elm memories check
        # --repair`; LangGraph lists namespaces that hold items
        paths = [namespace_path(ns) for ns in self.store.namespaces() if self.store.count(ns) > 0]
        paths = [p for p in paths if all(_matches_condition(p, c) for c in op.match_conditions or ())]
        if op.max_depth is not None:
            paths = [p[: op.max_depth] for p in paths]
        return sorted(set(paths))[op.offset : op.offset + op.limit]

    def _search(self, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        ranked: list[tuple[float | None, MemoryRecord, dict[str, Any]]] = []
        query_key: torch.Tensor | None = None
        for namespace in self.store.namespaces():
            if namespace_path(namespace)[: len(prefix)] != prefix:
                continue
            counters = self.store.utility_of(namespace)
            found = [(r, memory_value(r, counters.get(r.id))) for r in self.store.list(namespace)]
            found = [(r, v) for r, v in found if _matches(v, op.filter or {})]
            if not op.query:
                ranked.extend((None, r, v) for r, v in found)
            elif self.retriever is None:
                ranked.extend((s, r, v) for r, v in found if (s := _word_share(op.query, r.question)) > 0)
            else:
                if query_key is None:
                    query_key = self.retriever.query_key(op.query)
                scores = self._similarities(query_key, namespace)
                ranked.extend((scores[r.id], r, v) for r, v in found if r.id in scores)
        if op.query:
            ranked.sort(key=lambda x: (-(x[0] or 0.0), x[1].created_at, x[1].id))
        else:
            ranked.sort(key=lambda x: (x[1].created_at, x[1].id))
        return [
            SearchItem(
                namespace=namespace_path(r.namespace),
                key=r.id,
                value=v,
                created_at=_timestamp(r.created_at),
                updated_at=_timestamp(r.created_at),
                score=score,
            )
            for score, r, v in ranked[op.offset : op.offset + op.limit]
        ]

    def _similarities(self, query_key: torch.Tensor, namespace: str) -> dict[str, float]:
        """Cosine similarity of the query's key to every memory of ``namespace`` indexed by the retriever's
        key kind (the store's own nearest-neighbour query, asked for all of them; no usage is counted)."""
        assert self.retriever is not None
        kind = self.retriever.kind
        total = self.store.count(namespace, kind=kind)
        hits = self.store.query(kind, query_key, namespace, k=total) if total else []
        return {h.record.id: float(h.score) for h in hits}

    def _delete(self, namespace: str, memory_id: str) -> None:
        """The store's journalled delete, then a check that rows, blob and counters are gone."""
        try:
            record = self.store.record(memory_id, namespace)
        except MemoryNotFoundError:
            return
        self.store.delete(memory_id, namespace)
        left: list[str] = []
        try:
            self.store.record(memory_id, namespace)
            left.append("index rows")
        except MemoryNotFoundError:
            pass
        blobs = getattr(self.store, "blobs", None)
        if blobs is not None and record.blob and blobs.exists(record.blob):
            left.append(f"blob {record.blob[:12]}")
        if memory_id in self.store.utility_of(namespace, [memory_id]):
            left.append("utility counters")
        if left:
            raise StoreError(
                f"memory {memory_id} of namespace {namespace!r} is not fully deleted ({', '.join(left)} remain): "
                "it was learned again meanwhile, or run `elm memories check --repair`"
            )


def langgraph_store(elm: ELM, *, semantic_search: bool = False) -> ELMStore:
    """The ELM's memory store as a LangGraph ``BaseStore``.

    ``semantic_search=False``: the configured store opened without a model (nothing loads; every model's
    memories are listed); a search query ranks by the words of the stored question.
    ``semantic_search=True``: the ELM's own retriever (its model loads now if it has not yet: the same
    instance the graph answers with, never a second copy); only that model's memories are seen, and a
    query ranks them by ELM's retrieval keys.
    """
    if not semantic_search:
        return ELMStore.from_config(elm.config)
    retriever = elm.retriever
    if retriever is None:
        raise ConfigError("store.kind is 'none': there is no memory store to search")
    return ELMStore(retriever.store, retriever=retriever)
