"""Hostile input (issue 19): one regression test per defect a hostile-input probe found.

No real model: memories are built for fake ModelInfos, the CLI runs in-process with
typer's CliRunner, and the ELM facade gets stand-ins where a test must prove that no
model work starts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _fakes import fake_memory, fake_model_info, prepare_fake_model
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.config import ELMConfig, parse_override
from elm_memory.elm import ELM as RealELM
from elm_memory.errors import (
    ConfigError,
    IncompatibleMemoryError,
    InvalidNamespaceError,
    MemoryFormatError,
    MemoryIdConflictError,
)
from elm_memory.memory import MAX_HEADER_BYTES, MAX_QUESTION_CHARS, LatentMemory, MemoryMeta, TrainingStats
from elm_memory.models.loading import ModelInfo
from elm_memory.store.chroma import ChromaMemoryStore

HIDDEN = 8
FP = "5a5a5a5a5a5a5a5a"  # the "right" fingerprint: a model prepared on this machine (see prepared_model)


def model_info(hidden: int = HIDDEN, fingerprint: str = FP) -> ModelInfo:
    return fake_model_info(hidden, fingerprint)


def make_memory(info: ModelInfo, namespace: str = "default", seed: int = 0, memory_id: str | None = None):
    return fake_memory(info, namespace, seed, memory_id=memory_id, stats=TrainingStats(steps=1))


def craft(path: Path, memory: LatentMemory, extra_metadata: dict | None = None, **meta) -> Path:
    """Write a memory file as a hostile user would: metadata fields set directly, no validation."""
    from safetensors.torch import save

    raw = json.loads(memory.meta.to_json()) | meta
    tensors = {"soft_prompt": memory.soft_prompt, **{f"key.{k}": v for k, v in memory.keys.items()}}
    path.write_bytes(save(tensors, metadata={"elm_memory": json.dumps(raw), **(extra_metadata or {})}))
    return path


def invoke(app, *args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line_error(res, text: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and text in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def assert_nothing_stored(root: Path) -> None:
    store = ChromaMemoryStore(root)
    assert store.count() == 0 and list(store.blobs) == []


# 1. path traversal -----------------------------------------------------------------------


def test_ids_are_hex_on_import_and_export_never_leaves_its_folder(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "store"
    good = make_memory(model_info())
    for bad in ("../escaped", str(tmp_path / "abs"), "..", "ABCDEF0123456789", "0123abcd\n"):
        res = invoke(memories_app, "import", craft(tmp_path / "bad.safetensors", good, id=bad), "--store", root)
        assert_one_line_error(res, "invalid memory id")
    assert_nothing_stored(root)
    assert not (tmp_path / "escaped.safetensors").exists()

    # a store written before ids were checked may hold one; export must refuse it, writing nothing
    store = ChromaMemoryStore(root)
    store.put(good)
    monkeypatch.setattr(MemoryMeta, "validate", lambda self: None)
    store.put(make_memory(model_info(), seed=1, memory_id="../../escaped"))
    monkeypatch.undo()
    out = tmp_path / "out" / "dir"
    res = invoke(memories_app, "export", out, "--store", root)
    assert_one_line_error(res, "invalid memory id")
    assert not (tmp_path / "escaped.safetensors").exists() and not out.exists()


# 2. an id reused under another namespace ---------------------------------------------------


def test_import_of_an_id_used_by_another_namespace_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ChromaMemoryStore(root)
    victim = make_memory(model_info(), "victim", seed=1)
    store.put(victim)
    attacker = make_memory(model_info(), "attacker", seed=2, memory_id=victim.id)
    res = invoke(memories_app, "import", craft(tmp_path / "a.safetensors", attacker), "--store", root)
    assert_one_line_error(res, "already used in namespace 'victim'")
    other_model = make_memory(model_info(fingerprint="ffffffffffffffff"), "victim", seed=3, memory_id=victim.id)
    with pytest.raises(MemoryIdConflictError):
        store.put(other_model)
    assert store.count() == 1 and len(list(store.blobs)) == 1
    assert store.check(repair=True).ok
    assert torch.equal(store.get(victim.id, "victim").soft_prompt, victim.soft_prompt)


def test_repair_keeps_both_memories_of_a_store_that_already_holds_a_shared_id(tmp_path: Path, monkeypatch) -> None:
    store = ChromaMemoryStore(tmp_path / "store")
    victim = make_memory(model_info(), "victim", seed=1)
    store.put(victim)
    monkeypatch.setattr(ChromaMemoryStore, "_check_against_store", lambda self, memories: None)  # an older version
    store.put(make_memory(model_info(), "attacker", seed=2, memory_id=victim.id))
    monkeypatch.undo()
    report = store.check(repair=True)
    assert any(e.startswith(victim.id) and "'victim'" in e for e in report.errors), report.errors
    assert len(list(store.blobs)) == 2 and store.count("victim") == 1 and store.count("attacker") == 1
    assert torch.equal(store.get(victim.id, "victim").soft_prompt, victim.soft_prompt)


# 3. a wrong-shaped import blocking a namespace ----------------------------------------------


@pytest.fixture
def prepared_model(tmp_path: Path, monkeypatch) -> Path:
    """A model 'prepared' in $ELM_HOME: its marker (fingerprint) and config.json, no weights."""
    home = tmp_path / "elm-home"
    folder = prepare_fake_model(home, FP, HIDDEN)
    monkeypatch.setenv("ELM_HOME", str(home))
    return folder


def test_import_checks_shapes_against_the_model(tmp_path: Path, prepared_model: Path) -> None:
    root = tmp_path / "store"
    wrong = make_memory(model_info(hidden=100))  # the right fingerprint, the wrong hidden size
    res = invoke(memories_app, "import", craft(tmp_path / "w.safetensors", wrong), "--store", root)
    assert_one_line_error(res, "hidden size 100")
    bad_key = make_memory(model_info(), seed=1)
    bad_key.keys = {"kv": torch.randn(5)}  # kv keys of this model have 2 layers x 4 = 8 dims
    res = invoke(memories_app, "import", craft(tmp_path / "k.safetensors", bad_key), "--store", root)
    assert_one_line_error(res, "'kv' key has 5 dimensions")
    assert_nothing_stored(root)
    right = make_memory(model_info(), seed=2)
    assert invoke(memories_app, "import", craft(tmp_path / "r.safetensors", right), "--store", root).exit_code == 0
    # a model not prepared here: the shapes the store already indexed for it are the reference
    unknown = "0000000011111111"
    ChromaMemoryStore(root).put(make_memory(model_info(fingerprint=unknown), "a", seed=3))
    wrong_unknown = make_memory(model_info(hidden=100, fingerprint=unknown), "b", seed=4)
    res = invoke(memories_app, "import", craft(tmp_path / "u.safetensors", wrong_unknown), "--store", root)
    assert_one_line_error(res, "has hidden size 100")
    assert ChromaMemoryStore(root).count() == 2


def test_repair_resets_the_index_of_a_namespace_emptied_of_a_wrong_shaped_memory(tmp_path: Path) -> None:
    root = tmp_path / "store"
    info = model_info()
    unchecked = ChromaMemoryStore(root)  # no model known: how the bad file got in before the fix
    bad = make_memory(model_info(hidden=100), "ns")
    unchecked.put(bad)
    learner_store = ChromaMemoryStore(root, model=info)  # what learning with the real model writes through
    good = make_memory(info, "ns", seed=1)
    with pytest.raises(IncompatibleMemoryError, match="check --repair"):
        learner_store.put(good)
    assert unchecked.delete(bad.id)
    report = unchecked.check(repair=True)
    assert len(report.empty_collections) == 1 and report.ok
    learner_store.put(good)  # the namespace learns again (its cached handle predates the repair)
    hits = learner_store.query("input", good.keys["input"], "ns")
    assert [h.record.id for h in hits] == [good.id]


# 4. size limits on import --------------------------------------------------------------------


def test_import_limits_question_length_and_header_size(tmp_path: Path) -> None:
    root = tmp_path / "store"
    m = make_memory(model_info())
    long_question = craft(tmp_path / "q.safetensors", m, question="x" * (MAX_QUESTION_CHARS + 1))
    assert_one_line_error(invoke(memories_app, "import", long_question, "--store", root), "question too long")
    big_header = craft(tmp_path / "h.safetensors", m, extra_metadata={"pad": "x" * MAX_HEADER_BYTES})
    assert_one_line_error(invoke(memories_app, "import", big_header, "--store", root), "header is")
    with pytest.raises(MemoryFormatError, match="header"):
        LatentMemory.from_bytes(big_header.read_bytes())
    assert_nothing_stored(root)


# 5. tracebacks from --set, usage box for a question starting with "-" -------------------------


def test_set_with_bad_yaml_is_a_one_line_config_error() -> None:
    from elm_memory.cli import app

    for bad in ("training.steps=[", "x=!!python/name:os.system", "training..steps=1"):
        with pytest.raises(ConfigError, match="override"):
            parse_override(bad)
        assert_one_line_error(invoke(app, "config", "show", "--set", bad), "override")


class FakeELM:
    """Stands in for the facade: records what the CLI passed, does no model work."""

    calls: list[tuple[str, str, str]] = []

    def __init__(self, config):
        self.config = config

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def answer(self, question, *, namespace, learn=True):
        FakeELM.calls.append(("answer", question, namespace))
        return SimpleNamespace(to_dict=lambda: {"answer": None, "question": question})

    def learn(self, question, *, namespace):
        FakeELM.calls.append(("learn", question, namespace))
        meta = SimpleNamespace(namespace=namespace, question=question, stats=TrainingStats())
        return SimpleNamespace(id="0" * 32, meta=meta)

    def learn_many(self, questions, *, namespace):
        return [self.learn(q, namespace=namespace) for q in questions]


@pytest.fixture
def fake_elm(monkeypatch):
    import elm_memory.elm

    FakeELM.calls = []
    monkeypatch.setattr(elm_memory.elm, "ELM", FakeELM)
    return FakeELM.calls


def test_question_starting_with_a_dash_is_taken_as_the_question(fake_elm) -> None:
    from elm_memory.cli import app

    tiny = ("--preset", "cpu-tiny", "--json")
    assert invoke(app, "solve", "-3 + 5?", *tiny).exit_code == 0
    assert invoke(app, "solve", "-n", "ns", *tiny, "-- what is -x?").exit_code == 0
    assert invoke(app, "solve", *tiny, "--", "-x").exit_code == 0  # looks like an option: "--" says it is not
    assert invoke(app, "learn", "-(2+3)?", *tiny).exit_code == 0
    assert fake_elm == [
        ("answer", "-3 + 5?", "default"),
        ("answer", "-- what is -x?", "ns"),
        ("answer", "-x", "default"),
        ("learn", "-(2+3)?", "default"),
    ]
    res = invoke(app, "solve", "--jsn", "hi")  # a mistyped option is still an error, not a question
    assert res.exit_code == 2 and len(fake_elm) == 4


# 6. namespace validated before any work ------------------------------------------------------------


def test_namespace_is_validated_before_any_model_work(monkeypatch, fake_elm) -> None:
    import elm_memory.elm
    from elm_memory.cli import app
    from elm_memory.store import names
    from elm_memory.store.chroma import store as chroma

    def no_model(*args, **kwargs):
        raise AssertionError("model work started")

    monkeypatch.setattr(elm_memory.elm, "load_model", no_model)
    facade = RealELM(ELMConfig.load(preset="cpu-tiny"))
    for bad, message in (("", "empty"), ("n" * 300, "too long"), ("a\nb", "printable"), (" a", "printable")):
        with pytest.raises(InvalidNamespaceError, match=message):
            facade.answer("What is 2+3?", namespace=bad)
        with pytest.raises(InvalidNamespaceError, match=message):
            facade.learn("What is 2+3?", namespace=bad)
    with pytest.raises(InvalidNamespaceError, match="empty"):  # "" from the config is no default either
        RealELM(ELMConfig.load(preset="cpu-tiny", overrides={"namespace": ""})).answer("hi")
    assert chroma.validate_namespace is names.validate_namespace  # the store's write-time rule is this one

    for bad, message in (("", "namespace is empty"), ("n" * 300, "namespace too long")):
        assert_one_line_error(invoke(app, "solve", "hi", "--preset", "cpu-tiny", "--namespace", bad), message)
        assert_one_line_error(invoke(app, "learn", "hi", "--preset", "cpu-tiny", "-n", bad), message)
    assert fake_elm == []


# 7. learner start-up race ------------------------------------------------------------------------


def test_concurrent_first_use_builds_one_learner(tmp_path: Path, monkeypatch) -> None:
    import elm_memory.jobs

    built = []

    def slow_build(*args, **kwargs):
        time.sleep(0.05)  # a real learner opens its queue and starts a thread: a window for the race
        built.append(SimpleNamespace(close=lambda wait=True: None))
        return built[-1]

    monkeypatch.setattr(elm_memory.jobs, "build_learner", slow_build)
    cfg = ELMConfig.load(
        preset="cpu-tiny", overrides={"learner": {"mode": "background", "queue_path": str(tmp_path / "q.sqlite3")}}
    )
    elm = RealELM(cfg, loaded=SimpleNamespace(info=SimpleNamespace(fingerprint=FP)), retriever=object())
    start = threading.Barrier(8)
    got = []

    def first_use():
        start.wait()
        got.append(elm.learner)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and all(g is built[0] for g in got) and len(got) == 8
