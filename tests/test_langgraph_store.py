"""ELM's memory pool as a LangGraph ``BaseStore`` (integrations/langgraph_store.py): namespaces, search,
get, verified delete, refused puts, async, a parent graph compiled with it, and the docs' example.

A real embedded Chroma store with fake memories (tests/_fakes.py): no model loads.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import TypedDict

import pytest
import torch
from _fakes import fake_memory, fake_model_info
from langgraph.config import get_store
from langgraph.graph import START, StateGraph
from langgraph.runtime import Runtime
from langgraph.store.base import GetOp, PutOp, SearchOp

from elm_memory.config import ELMConfig
from elm_memory.errors import (
    ConfigError,
    InvalidNamespaceError,
    InvalidStoreQueryError,
    MemoryFormatError,
    MemoryWriteRefusedError,
    StoreError,
)
from elm_memory.integrations.langgraph_store import ELMStore, elm_namespace, langgraph_store, namespace_path
from elm_memory.memory import TrainingStats
from elm_memory.models.loading import ModelInfo
from elm_memory.store.chroma import ChromaMemoryStore
from elm_memory.store.utility import SHOWN_COUNTERS

ROOT = Path(__file__).resolve().parents[1]
DOC_SECTION = "## Browsing memories through LangGraph's store interface"


@pytest.fixture
def info() -> ModelInfo:
    return fake_model_info()


@pytest.fixture
def memories(tmp_path: Path, info: ModelInfo) -> ChromaMemoryStore:
    return ChromaMemoryStore(tmp_path / "store", model=info)


def put(store: ChromaMemoryStore, info: ModelInfo, namespace: str, seed: int, question: str, **stats):
    """A fake memory with a fixed creation time (seed seconds after 1000), so 'oldest first' is known."""
    m = fake_memory(
        info,
        namespace,
        seed,
        question=question,
        stats=TrainingStats(steps=seed, majority_answer="42", majority_share=0.5, **stats),
    )
    m.meta.created_at = 1000.0 + seed
    store.put(m)
    return m


# ---- namespaces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "namespace, path",
    [
        ("default", ("default",)),
        ("user-ada", ("user-ada",)),
        ("team/ada", ("team", "ada")),
        ("ada@example.com", ("ada@example%2Ecom",)),
        ("50%/v1.2", ("50%25", "v1%2E2")),
        ("a//b", ("a%2F%2Fb",)),
        ("/lead", ("%2Flead",)),
    ],
)
def test_namespace_mapping_is_reversible(namespace: str, path: tuple[str, ...]) -> None:
    assert namespace_path(namespace) == path
    assert elm_namespace(path) == namespace
    assert all(label and "." not in label for label in path)  # what LangGraph allows in a label


@pytest.mark.parametrize(
    "path, message",
    [
        (("a%2Fb",), r"write it \('a', 'b'\)"),  # another spelling of "a/b"
        (("team/ada",), r"write it \('team', 'ada'\)"),
        (("50%",), r"write it \('50%25',\)"),
        ((), "empty"),
        ((" padded",), "leading or trailing"),
    ],
)
def test_other_spellings_and_invalid_namespaces_are_refused(path: tuple[str, ...], message: str) -> None:
    with pytest.raises(InvalidNamespaceError, match=message):
        elm_namespace(path)


def test_list_namespaces_with_prefix_suffix_depth_and_paging(memories, info) -> None:
    for seed, ns in enumerate(["user-ada", "team/ada", "team/bob", "team/bob/drafts"]):
        put(memories, info, ns, seed, f"question {seed}?")
    store = ELMStore(memories)
    everything = [("team", "ada"), ("team", "bob"), ("team", "bob", "drafts"), ("user-ada",)]
    assert store.list_namespaces() == everything
    assert store.list_namespaces(prefix=("team",)) == everything[:3]
    assert store.list_namespaces(prefix=("team", "*", "drafts")) == [("team", "bob", "drafts")]
    assert store.list_namespaces(suffix=("ada",)) == [("team", "ada")]
    assert store.list_namespaces(suffix=("*", "bob")) == [("team", "bob")]
    assert store.list_namespaces(prefix=("team",), suffix=("drafts",)) == [("team", "bob", "drafts")]
    assert store.list_namespaces(max_depth=1) == [("team",), ("user-ada",)]
    assert store.list_namespaces(prefix=("team",), max_depth=2) == [("team", "ada"), ("team", "bob")]
    assert store.list_namespaces(limit=2, offset=1) == everything[1:3]
    assert store.list_namespaces(prefix=("nobody",)) == []


# ---- search and get ------------------------------------------------------------------------------


@pytest.fixture
def ada(memories, info):
    """Four memories of user-ada (oldest first), one of them without consensus, and one of team/ada."""
    ms = [
        put(memories, info, "user-ada", 1, "Tom has 3 apples and buys 4 more. How many apples?"),
        put(memories, info, "user-ada", 2, "What is 17 + 25?"),
        put(memories, info, "user-ada", 3, "A train leaves at 3 pm; when does it arrive?", no_consensus=True),
        put(memories, info, "user-ada", 4, "How many pears are left if Ada eats 2 of 5 pears?"),
    ]
    put(memories, info, "team/ada", 5, "How many apples does the team have?")
    return ms


def test_search_lists_metadata_oldest_first_never_tensors(memories, ada) -> None:
    store = ELMStore(memories)
    items = store.search(("user-ada",))
    assert [i.key for i in items] == [m.id for m in ada]
    first = items[0]
    assert first.namespace == ("user-ada",) and first.score is None
    assert first.created_at.timestamp() == 1001.0
    value = first.value
    assert value["question"] == ada[0].meta.question and value["question_truncated"] is False
    assert value["memory_kind"] == "soft_prompt" and value["key_kinds"] == ["input"]
    assert value["model_fingerprint"] == ada[0].meta.model_fingerprint
    assert value["stats"]["train_steps"] == 1 and value["stats"]["majority_answer"] == "42"
    assert value["utility"]["won"] == 0 and value["utility"]["utility"] is None  # never counted
    assert list(value["utility"]) == list(SHOWN_COUNTERS)  # the counters `elm memories stats` shows
    json.dumps([i.dict() for i in items])  # JSON all the way down: no tensor, no bytes
    assert not any(isinstance(v, torch.Tensor) for i in items for v in i.value.values())
    # the empty prefix spans every namespace; a prefix of another namespace sees none of ada's
    assert len(store.search((), limit=100)) == 5
    assert [i.namespace for i in store.search(("team",))] == [("team", "ada")]


def test_a_long_question_is_marked_truncated(memories, info) -> None:
    put(memories, info, "default", 1, "How many apples? " * 30)
    [item] = ELMStore(memories).search(("default",))
    assert item.value["question_truncated"] is True and len(item.value["question"]) == 200


def test_search_filters_by_metadata_and_utility(memories, ada) -> None:
    store = ELMStore(memories)
    memories.record_outcome("user-ada", ada[1].id, "won", 0.9)

    def keys(**kw) -> list[str]:
        return [i.key for i in store.search(("user-ada",), **kw)]

    assert keys(filter={"no_consensus": True}) == [ada[2].id]
    assert keys(filter={"no_consensus": False}) == [ada[0].id, ada[1].id, ada[3].id]
    assert keys(filter={"stats": {"train_steps": {"$gte": 3}}}) == [ada[2].id, ada[3].id]
    assert keys(filter={"stats": {"train_steps": {"$gt": 1, "$lt": 4}}}) == [ada[1].id, ada[2].id]
    assert keys(filter={"utility": {"won": {"$gt": 0}}}) == [ada[1].id]
    assert keys(filter={"utility": {"utility": {"$gte": 0.5}}}) == [ada[1].id]  # never judged: no match
    assert keys(filter={"question": {"$ne": ada[0].meta.question}}) == [m.id for m in ada[1:]]
    assert keys(filter={"key_kinds": ["input"]}) == [m.id for m in ada]
    assert keys(filter={"no_consensus": 0}) == []  # False is not 0
    assert keys(filter={"stats": {"nothing": 1}}) == []


def test_search_limit_and_offset(memories, ada) -> None:
    store = ELMStore(memories)
    assert [i.key for i in store.search(("user-ada",), limit=2)] == [ada[0].id, ada[1].id]
    assert [i.key for i in store.search(("user-ada",), limit=2, offset=2)] == [ada[2].id, ada[3].id]
    assert store.search(("user-ada",), offset=4) == []
    with pytest.raises(InvalidStoreQueryError, match=">= 0"):
        store.search(("user-ada",), limit=-1)


def test_bad_filters_are_typed_errors_even_on_an_empty_store(memories, ada, tmp_path, info) -> None:
    empty = ELMStore(ChromaMemoryStore(tmp_path / "empty", model=info))
    with pytest.raises(InvalidStoreQueryError, match=r"unknown filter operator '\$regex' on 'question'"):
        empty.search((), filter={"question": {"$regex": "apple"}})
    with pytest.raises(InvalidStoreQueryError, match="mixes operators and fields"):
        empty.search((), filter={"stats": {"$gt": 1, "train_steps": 2}})
    with pytest.raises(InvalidStoreQueryError, match="'question' holds str"):
        ELMStore(memories).search(("user-ada",), filter={"question": {"$gt": 3}})


def test_query_without_a_retriever_ranks_by_the_questions_words(memories, ada) -> None:
    store = ELMStore(memories)
    items = store.search(("user-ada",), query="how many apples")
    # 3/3 words, then 2/3 (pears question: "how many"); the question with none of them is left out
    assert [i.key for i in items] == [ada[0].id, ada[3].id]
    assert items[0].score == pytest.approx(1.0) and items[1].score == pytest.approx(2 / 3)
    both = store.search((), query="APPLES")
    assert {i.key for i in both} == {ada[0].id} | {i.key for i in store.search(("team", "ada"))}
    assert [i.key for i in store.search(("user-ada",), query="apples", filter={"no_consensus": True})] == []


class KeyOf:
    """A stand-in for ELM's retriever: a question's key is the key of the memory whose question it is."""

    kind = "input"

    def __init__(self, store: ChromaMemoryStore, by_question: dict[str, torch.Tensor]):
        self.store, self.by_question, self.asked = store, by_question, []

    def query_key(self, question: str) -> torch.Tensor:
        self.asked.append(question)
        return self.by_question[question]


def test_query_with_the_retriever_ranks_by_elms_keys(memories, ada) -> None:
    asked = "something sharing no word with any stored question"
    retriever = KeyOf(memories, {asked: ada[2].keys["input"]})
    store = ELMStore(memories, retriever=retriever)
    assert store.semantic_search
    items = store.search(("user-ada",), query=asked)
    assert items[0].key == ada[2].id and items[0].score == pytest.approx(1.0, abs=1e-5)
    assert len(items) == 4 and [i.score for i in items] == sorted((i.score for i in items), reverse=True)
    assert retriever.asked == [asked]  # one key per search, not one per namespace
    filtered = store.search(("user-ada",), query=asked, filter={"no_consensus": False}, limit=2)
    assert ada[2].id not in [i.key for i in filtered] and len(filtered) == 2
    assert memories.utility_of("user-ada") == {}  # browsing is not a retrieval: no usage counted
    with pytest.raises(ConfigError, match="another memory store"):
        ELMStore(ChromaMemoryStore(memories.root, model=memories.model), retriever=retriever)


@pytest.mark.model
def test_semantic_search_through_elms_own_retriever(tmp_path, tiny_loaded) -> None:
    from elm_memory.memory.keys import key_builders
    from elm_memory.retrieval.retriever import Retriever

    bound = ChromaMemoryStore(tmp_path / "store", model=tiny_loaded.info)
    retriever = Retriever(bound, key_builders.get("input")(), tiny_loaded)
    questions = ["Tom has 3 apples and buys 4 more. How many apples?", "A train leaves at 3 pm; when is it due?"]
    learned = [
        retriever.index_memory(fake_memory(tiny_loaded.info, "user-ada", i, question=q))
        for i, q in enumerate(questions)
    ]
    store = ELMStore(bound, retriever=retriever)
    for memory, question in zip(learned, questions, strict=True):
        top = store.search(("user-ada",), query=question)[0]
        assert top.key == memory.id and top.score == pytest.approx(1.0, abs=1e-4)
    # ranked by key, so a question sharing no word with "apples" is ranked too (a word match would drop it)
    assert {i.key for i in store.search(("user-ada",), query="apples")} == {m.id for m in learned}


def test_get_returns_the_item_or_none(memories, ada) -> None:
    store = ELMStore(memories)
    item = store.get(("user-ada",), ada[1].id)
    assert item is not None and item.key == ada[1].id and item.namespace == ("user-ada",)
    assert item.value == store.search(("user-ada",), limit=2)[1].value
    assert store.get(("user-ada",), "0" * 32) is None  # no such memory
    assert store.get(("team", "ada"), ada[1].id) is None  # it is not in that namespace
    with pytest.raises(MemoryFormatError, match="memory id"):
        store.get(("user-ada",), "What is 17 + 25?")  # keys are memory ids


# ---- delete and put ------------------------------------------------------------------------------


def test_delete_removes_rows_blob_and_counters(memories, ada) -> None:
    store = ELMStore(memories)
    victim = memories.record(ada[0].id)
    memories.record_outcome("user-ada", victim.id, "won", 0.9)
    assert memories.blobs.exists(victim.blob)
    store.delete(("user-ada",), victim.id)
    assert not memories.blobs.exists(victim.blob)
    assert store.get(("user-ada",), victim.id) is None
    assert victim.id not in [i.key for i in store.search(("user-ada",))]
    assert memories.utility_of("user-ada", [victim.id]) == {}
    store.delete(("user-ada",), victim.id)  # gone already: nothing to do, no error
    store.put(("user-ada",), ada[1].id, None)  # LangGraph's other spelling of a delete
    assert [i.key for i in store.search(("user-ada",))] == [ada[2].id, ada[3].id]


def test_a_namespace_whose_memories_were_all_deleted_is_no_longer_listed(memories, ada) -> None:
    store = ELMStore(memories)
    assert ("user-ada",) in store.list_namespaces()
    for item in store.search(("user-ada",), limit=100):
        store.delete(("user-ada",), item.key)
    assert ("user-ada",) not in store.list_namespaces()
    assert "user-ada" in memories.namespaces()  # its empty collections are still there: only the listing changed


def test_a_delete_that_leaves_something_behind_is_an_error(memories, ada, monkeypatch) -> None:
    monkeypatch.setattr(memories, "delete", lambda memory_id, namespace=None: True)  # says done, did nothing
    with pytest.raises(StoreError, match=r"not fully deleted \(index rows, blob [0-9a-f]{12} remain\)"):
        ELMStore(memories).delete(("user-ada",), ada[0].id)


def test_put_of_a_value_is_refused_and_nothing_in_the_batch_runs(memories, ada) -> None:
    store = ELMStore(memories)
    with pytest.raises(MemoryWriteRefusedError, match="learned"):
        store.put(("user-ada",), ada[0].id, {"question": "hand-written"})
    with pytest.raises(MemoryWriteRefusedError):
        store.batch([PutOp(("user-ada",), ada[1].id, None), PutOp(("user-ada",), "note", {"text": "x"})])
    assert [i.key for i in store.search(("user-ada",))] == [m.id for m in ada]  # the delete did not run
    with pytest.raises(MemoryFormatError, match="memory id"):
        store.delete(("user-ada",), "not-an-id")


# ---- async --------------------------------------------------------------------------------------


def test_async_variants_match_the_sync_ones(memories, ada) -> None:
    store = ELMStore(memories)

    async def run():
        listed = await store.alist_namespaces(prefix=("user-ada",))
        found = await store.asearch(("user-ada",), filter={"no_consensus": True})
        got = await store.aget(("user-ada",), ada[0].id)
        both = await store.abatch([GetOp(("user-ada",), ada[1].id), SearchOp(("user-ada",), limit=1)])
        await store.adelete(("user-ada",), ada[0].id)
        with pytest.raises(MemoryWriteRefusedError):
            await store.aput(("user-ada",), ada[1].id, {"x": 1})
        return listed, found, got, both

    listed, found, got, both = asyncio.run(run())
    assert listed == [("user-ada",)]
    assert [i.key for i in found] == [ada[2].id]
    assert got is not None and got.key == ada[0].id
    assert both[0].key == ada[1].id and [i.key for i in both[1]] == [ada[0].id]
    assert store.get(("user-ada",), ada[0].id) is None and store.get(("user-ada",), ada[1].id) is not None


# ---- a parent graph compiled with the store ----------------------------------------------------------


class Parent(TypedDict):
    user_id: str
    recalled: list[str]
    count: int


def test_a_parent_graph_compiled_with_the_store_browses_elms_memories(memories, ada) -> None:
    def recall(state: Parent, runtime: Runtime) -> dict:
        items = runtime.store.search((f"user-{state['user_id']}",), filter={"no_consensus": False})
        return {"recalled": [i.value["question"] for i in items]}

    def count(state: Parent) -> dict:  # a node without a runtime parameter reaches it too
        return {"count": len(get_store().search((), limit=100))}

    builder = StateGraph(Parent)
    builder.add_node(recall)
    builder.add_node(count)
    builder.add_edge(START, "recall")
    builder.add_edge("recall", "count")
    graph = builder.compile(store=ELMStore(memories))
    out = graph.invoke({"user_id": "ada", "recalled": [], "count": 0})
    assert out["recalled"] == [ada[0].meta.question, ada[1].meta.question, ada[3].meta.question]
    assert out["count"] == 5


def test_an_async_parent_node_uses_the_async_interface(memories, ada) -> None:
    async def recall(state: Parent, runtime: Runtime) -> dict:
        items = await runtime.store.asearch(("user-ada",), query="apples")
        return {"recalled": [i.key for i in items]}

    builder = StateGraph(Parent)
    builder.add_node(recall)
    builder.add_edge(START, "recall")
    graph = builder.compile(store=ELMStore(memories))
    out = asyncio.run(graph.ainvoke({"user_id": "ada", "recalled": [], "count": 0}))
    assert out["recalled"] == [ada[0].id]


# ---- built from an ELM -------------------------------------------------------------------------------


def test_langgraph_store_opens_the_elms_store_without_a_model(tmp_path, info) -> None:
    from elm_memory.elm import ELM

    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"path": str(tmp_path / "s")}})
    put(ChromaMemoryStore(tmp_path / "s"), info, "user-ada", 1, "What is 2 + 3?")
    elm = ELM(cfg)
    store = langgraph_store(elm)
    assert [i.value["question"] for i in store.search(("user-ada",))] == ["What is 2 + 3?"]
    assert not store.semantic_search and elm._loaded is None  # nothing loaded a model

    bound = ChromaMemoryStore(tmp_path / "s", model=info)
    retriever = KeyOf(bound, {"sum?": bound.get(store.search(())[0].key).keys["input"]})
    semantic = langgraph_store(ELM(cfg, retriever=retriever), semantic_search=True)
    assert semantic.store is bound and semantic.search((), query="sum?")[0].score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ConfigError, match="'none'"):
        langgraph_store(ELM(ELMConfig.load(preset="cpu-tiny", overrides={"store": {"kind": "none"}})))


# ---- the docs' example ---------------------------------------------------------------------------------


def doc_blocks() -> list[str]:
    text = (ROOT / "docs" / "agents.md").read_text()
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_docs_example_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ELM_HOME", str(tmp_path))  # the preset's store, under a fresh data home
    from elm_memory.config.location import resolve_store_path

    info = fake_model_info()
    folder = resolve_store_path(ELMConfig.load(preset="cpu-demo").store.path)
    seeded = ChromaMemoryStore(folder)
    apples = put(seeded, info, "user-ada", 1, "Tom has 3 apples and buys 4 more. How many apples?")
    sums = put(seeded, info, "user-ada", 2, "What is 17 + 25?")
    apples_blob = seeded.record(apples.id).blob
    blocks = doc_blocks()
    assert blocks, f"no python block under {DOC_SECTION!r} in docs/agents.md"
    from elm_memory import ELM

    # the page's block continues its first one, whose `elm` answered a question; here the store is seeded instead
    scope: dict = {"elm": ELM(ELMConfig.load(preset="cpu-demo"))}
    for block in blocks:
        exec(compile(block, "docs/agents.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert apples.meta.question in printed and "('user-ada',)" in printed
    assert [r.id for r in seeded.list("user-ada")] == [sums.id]  # the example deleted the oldest memory
    assert not seeded.blobs.exists(apples_blob)
