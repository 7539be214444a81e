"""Fuzzed inputs on the public surfaces (issue 18, item 2), with Hypothesis.

Each property feeds generated input to one surface and accepts exactly two outcomes:

- a typed error (:class:`~elm_memory.errors.ELMError`, the class the surface documents) whose
  message is one line, with nothing written outside the store and nothing stored; or
- the input is valid: it is accepted and round-trips (a question comes back stripped, a
  namespace lists and queries its memory, a config reloads equal from its YAML, a memory
  file reloads bit-identical).

Any other exception fails the property. Surfaces: questions (``validate_question`` and the
ELM entry points, which must refuse before any model work), namespaces (the rule and a real
embedded Chroma store), ``--set`` values and config files, memory files (``from_bytes``,
``load``, a store, ``elm memories import``), another model's memories, PEFT adapter folders, and
the CLI (exit code 2 and one ``error:`` line). The inputs with which fuzzing found defects are
kept as fixed cases (``test_inputs_that_found_bugs_stay_refused``).

No model is loaded: memories are built for fake ModelInfos (``_fakes.py``) and a stand-in
replaces model loading where a test must prove that no model work starts. Every property runs
twice: a short default variant (deterministic inputs, part of ``pytest -m "not slow"``) and a
``slow`` one with many more random inputs. The inputs tried and the typed-error rate of each
surface are printed after the module (``fuzz: ...`` lines), and ``ELM_FUZZ_REPORT=FILE``
writes them as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import yaml
from _fakes import fake_memory, fake_model_info, prepare_fake_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from safetensors.torch import save
from typer.testing import CliRunner

import elm_memory.elm
from elm_memory.backends.prompting import validate_question
from elm_memory.cli import app
from elm_memory.config import ELMConfig, parse_override, parse_overrides
from elm_memory.elm import ELM
from elm_memory.errors import (
    AdapterError,
    ConfigError,
    ELMError,
    IncompatibleMemoryError,
    InvalidNamespaceError,
    InvalidQuestionError,
    MemoryFormatError,
    StoreError,
)
from elm_memory.memory import MAX_FILE_BYTES, MAX_HEADER_BYTES, LatentMemory, TrainingStats
from elm_memory.memory.ids import MAX_NAMESPACE_CHARS, validate_namespace
from elm_memory.store.chroma import ChromaMemoryStore

HIDDEN = 8
FP = "5a5a5a5a5a5a5a5a"
INFO = fake_model_info(HIDDEN, FP)
ELM_BIN = Path(sys.executable).with_name("elm")

# ---- settings and bookkeeping -----------------------------------------------------------------

#: The default run: deterministic inputs (the same every run, so CI is repeatable), no example
#: database (nothing written into the repository), no deadline (the machine may be busy).
DEFAULT = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
#: The slow variant: fresh random inputs each run, many more of them.
SLOW = settings(DEFAULT, derandomize=False)

#: surface -> inputs tried / ended in a typed error (printed after the module).
TRIED: Counter[str] = Counter()
TYPED: Counter[str] = Counter()


class Budget(NamedTuple):
    """How many inputs a property gets, and whether they are the slow run's fresh random ones."""

    examples: int
    slow: bool


def variants(default: int, slow: int) -> Any:
    """Parametrize a property test over its default run and its ``slow`` run (example counts)."""
    return pytest.mark.parametrize(
        "examples",
        [
            pytest.param(Budget(default, False), id="default"),
            pytest.param(Budget(slow, True), id="slow", marks=pytest.mark.slow),
        ],
    )


def fuzz(strategy: st.SearchStrategy[Any], budget: Budget, check: Callable[[Any], None]) -> None:
    """Run ``check`` on inputs drawn from ``strategy``, as many as ``budget`` says."""
    settings(SLOW if budget.slow else DEFAULT, max_examples=budget.examples)(given(strategy)(check))()


def typed(surface: str, exc: BaseException, *classes: type[ELMError]) -> None:
    """Count a typed error and check its class and that its message is one line."""
    assert isinstance(exc, classes), f"{type(exc).__name__} is not one of {[c.__name__ for c in classes]}: {exc}"
    message = str(exc)
    assert message.strip() and "\n" not in message and "\r" not in message, repr(message)
    TYPED[surface] += 1


@contextmanager
def outcome(surface: str, *classes: type[ELMError]) -> Iterator[list[BaseException]]:
    """Count one input on ``surface``; a raised ELMError is checked and yielded (the block was refused),
    anything else propagates and fails the property."""
    TRIED[surface] += 1
    refused: list[BaseException] = []
    try:
        yield refused
    except ELMError as exc:
        typed(surface, exc, *classes)
        refused.append(exc)


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rows = {s: {"inputs": TRIED[s], "typed_errors": TYPED[s]} for s in sorted(TRIED)}
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown in the test log, not captured
            reporter.write_line("")
            for s, r in rows.items():
                rate = r["typed_errors"] / r["inputs"] if r["inputs"] else 0.0
                reporter.write_line(
                    f"fuzz: {s:<20} {r['inputs']:>6} inputs, {r['typed_errors']:>6} typed errors ({rate:.0%})"
                )
    if os.environ.get("ELM_FUZZ_REPORT"):
        Path(os.environ["ELM_FUZZ_REPORT"]).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def files_under(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def assert_only_under(root: Path, *allowed: str) -> None:
    """Every file below ``root`` is inside one of the ``allowed`` folders."""
    stray = [p for p in files_under(root) if not p.parts or p.parts[0] not in allowed]
    assert not stray, f"files written outside the store: {stray[:5]}"


def one_line_cli_error(res: Any) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stderr.startswith("error: "), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.output, res.output


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def words(text: str) -> list[str]:
    return text.split()


# ---- questions --------------------------------------------------------------------------------

SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
ANY_CHAR = st.characters(codec=None, exclude_categories=()) | SURROGATE
WHITESPACE = st.sampled_from(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2003\u2028\u2029\u202f\u3000")
CONTROL = st.integers(0, 0x1F).map(chr) | st.sampled_from("\x7f\x85\u200b\u200e\u202e\ufeff")
LATEX = st.lists(
    st.sampled_from(
        words(
            r"\frac{1}{2} \boxed{} \boxed{42} $$ $ \[ \] \sqrt{ } { \left( \right) \begin{align} \end{align} ^ _ \\ "
            r"\text{a} \mathbb{R} & %"
        )
    ),
    min_size=1,
    max_size=12,
).map("".join)


def _insert(text_and_char: tuple[str, str, int]) -> str:
    text, char, at = text_and_char
    at = at % (len(text) + 1)
    return text[:at] + char + text[at:]


QUESTIONS = st.one_of(
    st.just(""),
    st.text(WHITESPACE, max_size=30),
    st.text(ANY_CHAR, max_size=60),
    st.text(CONTROL, min_size=1, max_size=10),
    st.tuples(st.text(max_size=30), st.just("\x00"), st.integers(0, 64)).map(_insert),
    st.tuples(st.text(max_size=30), SURROGATE, st.integers(0, 64)).map(_insert),
    LATEX,
    st.tuples(WHITESPACE, LATEX, WHITESPACE).map("".join),
    st.integers(10_000, 2_000_000).map(lambda n: "What is 2+3? " * (n // 13)),  # huge
    st.binary(max_size=40),  # bytes: UTF-8 or not
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")),  # undecodable argv
    st.none() | st.integers() | st.lists(st.text(max_size=3), max_size=2),  # not text at all
)


def question_oracle(question: Any) -> str | None:
    """What ``validate_question`` must return (None: it must refuse), from the README's rules."""
    if isinstance(question, bytes):
        try:
            question = question.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(question, str) or "\x00" in question or not question.strip():
        return None
    if any(0xD800 <= ord(c) <= 0xDFFF for c in question):
        return None
    return question.strip()


def check_question(question: Any) -> None:
    expected = question_oracle(question)
    with outcome("questions", InvalidQuestionError) as refused:
        got = validate_question(question)
        assert got == expected, (question, got)
    if refused:
        assert expected is None, f"valid question refused: {question!r}: {refused[0]}"


@variants(300, 20_000)
def test_validate_question(examples: Budget) -> None:
    fuzz(QUESTIONS, examples, check_question)


class ModelWork(Exception):
    """Raised by the stand-in for model loading: the input got past validation."""


def no_model(*args: Any, **kwargs: Any) -> Any:
    raise ModelWork


@variants(100, 3_000)
def test_elm_entry_points_refuse_bad_questions_before_model_work(examples: Budget, tmp_path: Path) -> None:
    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"path": str(tmp_path / "store")}})
    elm = ELM(cfg)

    def check(question: Any) -> None:
        expected = question_oracle(question)
        for call in (
            lambda: elm.answer(question, learn=False),
            lambda: elm.learn(question),
            lambda: elm.learn_many(["What is 1+1?", question]),
        ):
            # a valid question reaches the model (ModelWork), an invalid one never does
            with outcome("questions (ELM)", InvalidQuestionError) as refused, pytest.raises(ModelWork):
                call()
            assert bool(refused) == (expected is None), (question, refused)
        assert files_under(tmp_path) == set(), "a refused question wrote files"

    with mock.patch.object(elm_memory.elm, "load_model", no_model):
        fuzz(QUESTIONS, examples, check)


BAD_QUESTIONS = QUESTIONS.filter(lambda q: isinstance(q, str) and question_oracle(q) is None and len(q) < 5000)


@variants(40, 1_000)
def test_cli_refuses_bad_questions_with_one_line(examples: Budget, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("ELM_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(elm_memory.elm, "load_model", no_model)

    def check(question: str) -> None:
        for command in ("solve", "learn"):
            with outcome("CLI"):
                res = invoke(command, "--preset", "cpu-tiny", "--", question)
                one_line_cli_error(res)
                assert "question" in res.stderr, res.stderr
                TYPED["CLI"] += 1
        assert files_under(tmp_path) == set()

    fuzz(BAD_QUESTIONS, examples, check)


# ---- namespaces -------------------------------------------------------------------------------

NAMESPACES = st.one_of(
    st.just(""),
    st.text(ANY_CHAR, max_size=40),
    st.text(st.sampled_from("/\\.~:*?<>|"), min_size=1, max_size=12),
    st.sampled_from(
        [
            "..",
            ".",
            "../x",
            "../../etc/passwd",
            "/abs/path",
            "C:\\win",
            "a/../../b",
            "~",
            "~root",
            "store/../../escape",
            "\\\\server\\share",
            "%2e%2e%2f",
            "team a/β",
            "ns\x00",
            " ns",
            "ns ",
        ]
    ),
    st.tuples(st.text(max_size=8), st.sampled_from(["/", "\\", "..", "\n", "\t", "\x00"]), st.text(max_size=8)).map(
        "".join
    ),
    st.integers(MAX_NAMESPACE_CHARS - 2, 10_000).map(lambda n: "n" * n),  # around the cap, up to 10k
    st.text(st.characters(min_codepoint=0x80), min_size=1, max_size=20),  # unicode
    st.none() | st.integers() | st.binary(max_size=4),
)


def namespace_oracle(ns: Any) -> bool:
    return isinstance(ns, str) and 0 < len(ns) <= MAX_NAMESPACE_CHARS and ns.isprintable() and ns == ns.strip()


def check_namespace_rule(ns: Any) -> None:
    with outcome("namespaces", InvalidNamespaceError) as refused:
        assert validate_namespace(ns) == ns
    assert bool(refused) != namespace_oracle(ns), (ns, refused)


@variants(300, 20_000)
def test_validate_namespace(examples: Budget) -> None:
    fuzz(NAMESPACES, examples, check_namespace_rule)


@variants(60, 400)
def test_namespaces_in_a_real_store(examples: Budget, tmp_path: Path) -> None:
    """Valid names list and query their own memory (only theirs); invalid ones store nothing; no
    name, whatever its separators or dots, makes the store write outside its folder."""
    store = ChromaMemoryStore(tmp_path / "store", model=INFO)
    seeds = iter(range(10**9))

    def check(ns: Any) -> None:
        if not isinstance(ns, str):
            ns = repr(ns)  # the store takes text; non-text is covered by the rule above
        memory = fake_memory(INFO, ns, next(seeds), stats=TrainingStats(steps=1))
        before_count, before_blobs = store.count(), set(store.blobs)
        with outcome("namespaces (store)", InvalidNamespaceError) as refused:
            store.put(memory)
            listed = store.list(ns)
            assert memory.id in {r.id for r in listed} and {r.namespace for r in listed} == {ns}
            hits = store.query("input", memory.keys["input"], ns, k=len(listed))
            assert hits[0].record.id == memory.id and hits[0].score == pytest.approx(1.0, abs=1e-4)
            assert {h.record.namespace for h in hits} == {ns}
            assert torch.equal(store.get(memory.id, ns).soft_prompt, memory.soft_prompt)
        assert bool(refused) != namespace_oracle(ns), (ns, refused)
        if refused:
            assert store.count() == before_count and set(store.blobs) == before_blobs
        assert_only_under(tmp_path, "store")

    fuzz(NAMESPACES, examples, check)
    assert store.check().ok


# ---- --set values and config files ------------------------------------------------------------


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += field_paths(sub, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


FIELDS = field_paths(ELMConfig)
YAML_ATOMS = st.sampled_from(
    words(
        "1 -1 0 2 0.5 1e309 -.inf .nan true no null ~ [ ] { } !!python/name:os.system 'x' \"\\x00\" "
        "~nouserxyz/x ~/x /tmp/x .. 2020-01-01 0x1F 1_000 cpu auto bfloat16 input kv lru utility background "
        "sync off native trl prefix user_turn hf vllm-server http://127.0.0.1:1 user-{user_id} { % @ ` | > "
    )
    + ["", "[1, 2]", "{a: 1}", "!!binary aGk=", "&a [*a]", "9" * 5000, "[" * 3000, "{a: " * 200]
)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
VALUES = st.one_of(
    YAML_ATOMS,
    st.text(max_size=30),
    st.lists(YAML_ATOMS, min_size=1, max_size=4).map(" ".join),
    JSONISH.map(json.dumps),
)
KEYS = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(FIELDS).map(lambda f: f.split(".")[0]),  # a whole section
    st.tuples(st.sampled_from(FIELDS), st.text(max_size=6)).map(".".join),  # one level too deep
    st.text(max_size=20),
)


def default_of(dotted: str) -> Any:
    value: Any = ELMConfig().model_dump(mode="json")
    for k in dotted.split("."):
        value = value.get(k) if isinstance(value, dict) else None
    return value


#: Values a field plausibly takes (its default, small numbers, flags), so that accepted configs are
#: common enough for their round trip to be tested too.
PLAUSIBLE = st.sampled_from(FIELDS).flatmap(
    lambda f: st.tuples(
        st.just(f),
        st.one_of(
            st.just(default_of(f)), st.integers(0, 64), st.floats(0, 1), st.booleans(), st.text("abc-_", max_size=6)
        ).map(lambda v: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()),
    )
)
SETS = st.one_of(st.tuples(KEYS, VALUES).map("=".join), PLAUSIBLE.map("=".join), st.text(ANY_CHAR, max_size=40))


def reloads_equal(cfg: ELMConfig) -> None:
    """An accepted config round-trips through what `elm config show` prints, which never holds the
    secret (``backend.server_api_key`` is left out on purpose, so it is compared without it)."""
    text = cfg.to_yaml()
    assert "server_api_key" not in text and "server_api_key" not in json.dumps(cfg.model_dump(mode="json"))
    assert ELMConfig.from_dict(yaml.safe_load(text)).model_dump(mode="json") == cfg.model_dump(mode="json")


def check_sets(items: list[str]) -> None:
    with outcome("--set values", ConfigError):
        cfg = ELMConfig.load(overrides=parse_overrides(items))
        reloads_equal(cfg)


@variants(300, 20_000)
def test_set_overrides_load_or_raise_config_error(examples: Budget) -> None:
    fuzz(st.lists(SETS, min_size=1, max_size=3), examples, check_sets)


@variants(40, 1_000)
def test_cli_set_values(examples: Budget, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("ELM_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)

    def check(item: str) -> None:
        with outcome("CLI"):
            res = invoke("config", "show", "--set", item)
            if res.exit_code == 0:  # accepted: the printed config is the one the library loads
                loaded = ELMConfig.load(overrides=parse_override(item))
                assert "server_api_key" not in res.stdout
                assert ELMConfig.from_dict(yaml.safe_load(res.stdout)).model_dump() == loaded.model_dump()
            else:
                one_line_cli_error(res)
                TYPED["CLI"] += 1
        assert files_under(tmp_path) == set()

    fuzz(SETS, examples, check)


CONFIG_TEXTS = st.one_of(
    st.dictionaries(KEYS, VALUES.map(lambda v: yaml.safe_load(v) if _yaml_ok(v) else v), max_size=6).map(
        lambda d: _nest(d)
    ),
    st.text(ANY_CHAR.filter(lambda c: not 0xD800 <= ord(c) <= 0xDFFF), max_size=200),
    st.lists(st.tuples(KEYS, VALUES).map(": ".join), max_size=6).map("\n".join),
    st.lists(PLAUSIBLE, max_size=6).map(lambda kvs: _nest({k: yaml.safe_load(v) for k, v in kvs})),
    st.binary(max_size=100),
)


def _yaml_ok(text: str) -> bool:
    try:
        yaml.safe_load(text)
    except Exception:  # the generator's own filter: which values can be placed in a mapping
        return False
    return True


def _nest(flat: dict[str, Any]) -> str:
    """{"a.b": 1} -> "a:\\n  b: 1\\n"; keys that collide keep the last value."""
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        cur = out
        *heads, last = dotted.split(".")
        for k in heads:
            nxt = cur.get(k)
            cur[k] = nxt if isinstance(nxt, dict) else {}
            cur = cur[k]
        cur[last] = value
    return yaml.safe_dump(out, allow_unicode=True)


@variants(150, 10_000)
def test_config_files_load_or_raise_config_error(examples: Budget, tmp_path: Path) -> None:
    path = tmp_path / "in" / "config.yaml"
    path.parent.mkdir()

    def check(text: str | bytes) -> None:
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        with outcome("config files", ConfigError):
            reloads_equal(ELMConfig.load(path))
        assert_only_under(tmp_path, "in")

    fuzz(CONFIG_TEXTS, examples, check)


# ---- memory files -----------------------------------------------------------------------------

BASE = fake_memory(INFO, "default", 7, stats=TrainingStats(steps=1, mean_reward=[0.5]))
BASE_BYTES = BASE.to_bytes()
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]
ST_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "I32", "I64", "U8", "BOOL", "F8_E4M3", "F4", "XX", "", 7, None]


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: Any, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def _meta_dict() -> dict[str, Any]:
    return json.loads(BASE.meta.to_json())


META_FIELDS = sorted(_meta_dict()) + [f"stats.{k}" for k in sorted(_meta_dict()["stats"])] + ["extra", "stats.extra"]
SPECIAL = st.sampled_from(
    [
        float("nan"),
        float("inf"),
        -float("inf"),
        10**400,
        -(10**30),
        2**63,
        "",
        "..",
        "../x",
        "ABCDEF0123",
        "0" * 65,
        "x" * 300_000,
        None,
        [],
        {},
        True,
        "line\nbreak",
    ]
).map(copy.deepcopy)  # a fresh [] / {} each time: a shared one would carry one example's edits into the next


@st.composite
def meta_mutation(draw: st.DrawFn) -> bytes:
    """A memory whose JSON metadata has fields set to other values or removed."""
    meta = _meta_dict()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(META_FIELDS)).split(".")
        target = meta["stats"] if len(path) == 2 and isinstance(meta.get("stats"), dict) else meta
        if draw(st.booleans()) and path[-1] in target:
            del target[path[-1]]
        else:
            target[path[-1]] = draw(SPECIAL | JSONISH)
    text = (
        json.dumps(meta) if draw(st.booleans()) else draw(st.sampled_from(["[1]", '"x"', "{", "[" * 5000, "1" * 5000]))
    )
    tensors = {"soft_prompt": BASE.soft_prompt, "key.input": BASE.keys["input"]}
    return save(tensors, metadata={"elm_memory": text})


@st.composite
def tensor_mutation(draw: st.DrawFn) -> bytes:
    """Soft prompts and keys of other shapes and dtypes, with NaN or inf, too many or badly named keys."""
    shape = draw(st.lists(st.integers(0, 10), max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    values = torch.randn(tuple(shape)) * draw(st.sampled_from([1.0, 1e30, 1e300]))
    if values.numel() and draw(st.booleans()):
        values.view(-1)[draw(st.integers(0, values.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
    tensor = values.to(dtype)
    tensors = {"soft_prompt": BASE.soft_prompt, "key.input": BASE.keys["input"]}
    name = draw(st.sampled_from(["soft_prompt", "key.input", "key.kv", "other"]))
    tensors[name] = tensor
    if draw(st.booleans()):
        del tensors[draw(st.sampled_from(sorted(tensors)))]
    for kind in draw(st.lists(st.text(max_size=70), max_size=3)) + ["k"] * draw(st.sampled_from([0, 0, 17])):
        tensors[f"key.{kind}" + (str(len(tensors)) if kind == "k" else "")] = torch.randn(HIDDEN)
    meta = _meta_dict()
    if draw(st.booleans()) and "soft_prompt" in tensors and tensors["soft_prompt"].dim() == 2:
        meta["num_tokens"], meta["hidden_size"] = tensors["soft_prompt"].shape  # shapes agree with the metadata
    return save(tensors, metadata={"elm_memory": json.dumps(meta)})


@st.composite
def header_mutation(draw: st.DrawFn) -> bytes:
    """Safetensors headers that lie: dtypes, shapes (huge ones too) and offsets, extra entries."""
    header, body = split(BASE_BYTES)
    name = draw(st.sampled_from(["soft_prompt", "key.input", "key.big", "__metadata__"]))
    entry = dict(header.get(name) or {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
    if name == "__metadata__":
        header[name] = draw(JSONISH | st.just({"elm_memory": 5}))
    else:
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "all"]))
        if field in ("dtype", "all"):
            entry["dtype"] = draw(st.sampled_from(ST_DTYPES))
        if field in ("shape", "all"):
            dim = st.integers(0, 16) | st.sampled_from([2**31, 2**40, 2**62, 2**64 + 1, -1])
            entry["shape"] = draw(st.lists(dim, max_size=4))
        if field in ("data_offsets", "all"):
            off = st.integers(0, len(body) + 8) | st.sampled_from([2**40, 2**64, -1])
            entry["data_offsets"] = draw(st.lists(off, min_size=0, max_size=3))
        header[name] = entry
    cut = draw(st.sampled_from([len(body), len(body), 0, len(body) // 2, len(body) - 1]))
    return join(header, body[:cut])


@st.composite
def byte_mutation(draw: st.DrawFn) -> bytes:
    """Truncated files, flipped bytes, junk appended, a length prefix that lies."""
    data = bytearray(BASE_BYTES)
    kind = draw(st.sampled_from(["truncate", "flip", "append", "length"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "append":
        return bytes(data) + draw(st.binary(min_size=1, max_size=64))
    n = draw(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1]))
    return n.to_bytes(8, "little") + bytes(data[8:])


PICKLES = JSONISH.map(lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) | st.just(
    pickle.dumps(torch.randn(4, HIDDEN))
)
MEMORY_BYTES = st.one_of(
    meta_mutation(), tensor_mutation(), header_mutation(), byte_mutation(), PICKLES, st.binary(max_size=200)
)


def memory_property(store: ChromaMemoryStore, root: Path) -> Callable[[bytes], None]:
    """Refused with MemoryFormatError and nothing stored, or accepted: bit-identical round trip,
    then the store takes it (or refuses it with a typed error and keeps nothing of it)."""

    def check(data: bytes) -> None:
        with outcome("memory files", MemoryFormatError) as refused:
            memory = LatentMemory.from_bytes(data)
        if refused:
            return
        again = LatentMemory.from_bytes(memory.to_bytes())
        assert again.meta == memory.meta and torch.equal(again.soft_prompt, memory.soft_prompt)
        assert again.keys.keys() == memory.keys.keys() and all(
            torch.equal(again.keys[k], memory.keys[k]) for k in again.keys
        )
        before = (store.count(), set(store.blobs))
        with outcome("memory files (store)", StoreError, MemoryFormatError, IncompatibleMemoryError) as stored_refused:
            store.put(memory)
            assert torch.equal(store.get(memory.id, memory.meta.namespace).soft_prompt, memory.soft_prompt)
        if stored_refused:
            assert (store.count(), set(store.blobs)) == before
        assert_only_under(root, "store", "in")

    return check


@variants(300, 20_000)
def test_memory_files_are_refused_or_round_trip(examples: Budget, tmp_path: Path) -> None:
    store = ChromaMemoryStore(tmp_path / "store", known_models={FP: INFO})
    fuzz(MEMORY_BYTES, examples, memory_property(store, tmp_path))
    assert store.check().ok


def crafted(tensors: dict[str, torch.Tensor] | None = None, meta_text: str | None = None, **fields: Any) -> bytes:
    """BASE with metadata fields (``stats_x`` for ``stats.x``) or tensors replaced, unvalidated."""
    meta = _meta_dict()
    for name, value in fields.items():
        (meta["stats"] if name.startswith("stats_") else meta)[name.removeprefix("stats_")] = value
    tensors = tensors or {"soft_prompt": BASE.soft_prompt, "key.input": BASE.keys["input"]}
    return save(tensors, metadata={"elm_memory": meta_text if meta_text is not None else json.dumps(meta)})


def test_inputs_that_found_bugs_stay_refused(tmp_path: Path) -> None:
    """The inputs with which fuzzing found defects (untyped exceptions, a blob stored for a refused memory,
    a two-line message), kept as fixed cases so that the default run checks each of them every time."""
    memories = {
        "format is text": crafted(format="2"),  # was a TypeError (format compared with an int)
        "format is null": crafted(format=None),
        "created_at too big for a float": crafted(created_at=10**400),  # was an OverflowError after the blob
        "stats.seconds too big for a float": crafted(stats_seconds=10**400),
        "created_at is inf": crafted(created_at=float("inf")),  # was stored
        "majority_share is NaN": crafted(stats_majority_share=float("nan")),  # was stored
        "empty key": crafted({"soft_prompt": BASE.soft_prompt, "key.input": torch.zeros(0)}),  # blocked its index
        "metadata nested deeply": crafted(meta_text="[" * 100_000),  # was a RecursionError
        "fingerprint with a line break": crafted(model_fingerprint="\r"),  # was a two-line message
        "model name with a line break": crafted(model_name="a\nb"),
    }
    store = ChromaMemoryStore(tmp_path / "store", known_models={FP: INFO})
    for name, data in memories.items():
        with outcome("memory files", MemoryFormatError) as refused:
            LatentMemory.from_bytes(data)
        assert refused, name
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / "m.safetensors").write_bytes(data)
        res = invoke("memories", "import", str(tmp_path / "in" / "m.safetensors"), "--store", str(tmp_path / "store"))
        one_line_cli_error(res)
    assert store.count() == 0 and list(store.blobs) == []

    sets = ["training.steps=" + "9" * 5000, "store.path=~nouserxyz/x"]  # were ValueError, RuntimeError
    for item in sets:
        with outcome("--set values", ConfigError) as refused:
            ELMConfig.load(overrides=parse_overrides([item]))
        assert refused, item
    for text in ("[" * 100_000, "a: " + "{a: " * 5000, "steps: " + "9" * 5000):  # were RecursionError, ValueError
        (tmp_path / "in" / "c.yaml").write_text(text)
        with outcome("config files", ConfigError) as refused:
            ELMConfig.load(tmp_path / "in" / "c.yaml")
        assert refused, text[:20]
    one_line_cli_error(invoke("memories", "list", "--store", "~nouserxyz/s"))  # was a RuntimeError traceback
    assert_only_under(tmp_path, "in", "store")


def test_memory_load_refuses_renamed_pickles_and_oversized_files(tmp_path: Path) -> None:
    """Through ``LatentMemory.load`` (a path): a pickle renamed .safetensors, a 50 MB JSON header, a
    header declaring a huge tensor, a NaN soft prompt, a file larger than the cap."""
    cases = {
        "pickle.safetensors": pickle.dumps({"soft_prompt": torch.randn(4, HIDDEN)}),
        "header50mb.safetensors": join({"__metadata__": {"pad": "x" * (50 * 1024 * 1024)}}, b""),
        "huge.safetensors": join(
            {"soft_prompt": {"dtype": "F32", "shape": [2**40, 2**20], "data_offsets": [0, 4]}}, b"\0" * 4
        ),
        "nan.safetensors": save(
            {"soft_prompt": torch.full((4, HIDDEN), float("nan"))}, metadata={"elm_memory": BASE.meta.to_json()}
        ),
        "empty.safetensors": b"",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with outcome("memory files", MemoryFormatError) as refused:
            LatentMemory.load(tmp_path / name)
        assert refused, name
    big = tmp_path / "big.safetensors"
    with big.open("wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)  # sparse: over the cap without writing it
    with outcome("memory files", MemoryFormatError) as refused:
        LatentMemory.load(big)
    assert refused and "bytes (at most" in str(refused[0])


FINGERPRINTS = st.just(FP) | st.text("0123456789abcdef", min_size=1, max_size=20) | st.text(max_size=20)


ADAPTER_FILES = ("adapter_config.json", "elm_memory.json", "adapter_model.safetensors")


def _export_base_adapter(folder: Path) -> dict[str, bytes]:
    from elm_memory.memory.peft import export_adapter

    export_adapter(BASE, folder, position="prefix", base_model="fake")
    return {name: (folder / name).read_bytes() for name in ADAPTER_FILES}


def _adapter_bytes() -> dict[str, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _export_base_adapter(Path(tmp) / "adapter")


ADAPTER_BYTES = _adapter_bytes()


@st.composite
def adapter_mutation(draw: st.DrawFn) -> dict[str, bytes | None]:
    """Changes to an exported adapter's files (None: the file is removed)."""
    changes: dict[str, bytes | None] = {}
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(ADAPTER_FILES))
        if name == "adapter_model.safetensors":
            weights = save({"prompt_embeddings": BASE.soft_prompt}, metadata={"format": "pt"})
            changes[name] = draw(st.none() | MEMORY_BYTES | st.just(weights))
            continue
        original = json.loads(ADAPTER_BYTES[name])
        target = original["memory"] if name == "elm_memory.json" and draw(st.booleans()) else original
        key = draw(st.sampled_from(sorted(target) + ["extra"]))
        target[key] = draw(SPECIAL | JSONISH | st.integers(-2, 20))
        text = json.dumps(original)
        changes[name] = draw(
            st.none() | st.just(text.encode()) | st.binary(max_size=40) | JSONISH.map(lambda v: json.dumps(v).encode())
        )
    return changes


@variants(120, 5_000)
def test_adapter_folders_are_refused_or_round_trip(examples: Budget, tmp_path: Path) -> None:
    """A PEFT adapter folder with changed, missing or junk files: AdapterError (or the memory format and
    model errors it reports), else the memory read back is the one exported."""
    from elm_memory.memory.peft import check_adapter, read_adapter

    cfg = ELMConfig.load(overrides={"memory": {"num_tokens": BASE.meta.num_tokens}})
    folder = tmp_path / "in" / "adapter"

    def check(changes: dict[str, bytes | None]) -> None:
        for name in ADAPTER_FILES:
            data = changes.get(name, ADAPTER_BYTES[name])
            (folder / name).unlink(missing_ok=True)
            if data is not None:
                (folder / name).write_bytes(data)
        with outcome("adapter folders", AdapterError, MemoryFormatError, IncompatibleMemoryError) as refused:
            memory, position = read_adapter(folder)
            check_adapter(memory, folder, cfg, INFO)
        if not refused:
            assert position == "prefix" and torch.equal(memory.soft_prompt, BASE.soft_prompt)
            assert memory.meta.num_tokens == BASE.meta.num_tokens and memory.meta.hidden_size == HIDDEN
        assert_only_under(tmp_path, "in")

    _export_base_adapter(folder)
    fuzz(adapter_mutation(), examples, check)


@variants(60, 2_000)
def test_memories_of_another_model_are_refused(examples: Budget, tmp_path: Path) -> None:
    """A memory made for another model (fingerprint or hidden size) is refused by the model check and
    by a store bound to the model, which keeps nothing of it."""
    store = ChromaMemoryStore(tmp_path / "store", model=INFO)
    store.put(fake_memory(INFO, "default", 1))
    seeds = iter(range(100, 10**9))

    def check(other: tuple[str, int]) -> None:
        fingerprint, hidden = other
        with outcome("model fingerprint", MemoryFormatError) as refused:  # e.g. a fingerprint with a newline
            foreign = fake_memory(fake_model_info(hidden, fingerprint), "default", next(seeds))
        if refused:
            assert not fingerprint.isprintable()
            return
        same = (fingerprint, hidden) == (FP, HIDDEN)
        with outcome("model fingerprint", IncompatibleMemoryError) as refused:
            LatentMemory.from_bytes(foreign.to_bytes()).check_compatible(INFO)
        assert bool(refused) != same
        with outcome("model fingerprint", IncompatibleMemoryError) as refused:
            store.put(foreign)
        assert bool(refused) != same
        if refused:
            assert foreign.id not in {r.id for r in store.list()}
        assert_only_under(tmp_path, "store")

    fuzz(st.tuples(FINGERPRINTS, st.sampled_from([HIDDEN, HIDDEN, 4, 16])), examples, check)


@pytest.fixture
def prepared_home(tmp_path: Path, monkeypatch) -> Path:
    """$ELM_HOME with one 'prepared' model (marker and config.json, no weights): what import checks
    memories against."""
    prepare_fake_model(tmp_path / "home", FP, HIDDEN)
    monkeypatch.setenv("ELM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def wrong_shape_for_model(seed: int) -> bytes:
    return fake_memory(fake_model_info(16, FP), "default", seed).to_bytes()


BAD_MEMORY_BYTES = MEMORY_BYTES.filter(lambda b: _refused(b)) | st.integers(0, 10**6).map(wrong_shape_for_model)


def _refused(data: bytes) -> bool:
    try:
        LatentMemory.from_bytes(data)
    except MemoryFormatError:
        return True
    return False


@variants(40, 1_000)
def test_cli_import_refuses_bad_memory_files(
    examples: Budget, tmp_path: Path, prepared_home: Path, monkeypatch
) -> None:
    """`elm memories import` exits 2 with one line and stores nothing."""
    monkeypatch.delenv("ELM_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "in" / "memory.safetensors"
    path.parent.mkdir()

    def check(data: bytes) -> None:
        path.write_bytes(data)
        with outcome("CLI"):
            res = invoke("memories", "import", str(path), "--store", str(tmp_path / "store"))
            one_line_cli_error(res)
            TYPED["CLI"] += 1
        # refused while reading (most): no store at all; refused by the store (wrong shapes): no blob
        assert not any(p.is_file() for p in (tmp_path / "store" / "blobs").rglob("*")), "a refused import stored"
        assert_only_under(tmp_path, "in", "home", "store")

    fuzz(BAD_MEMORY_BYTES, examples, check)
    if (tmp_path / "store").exists():
        assert ChromaMemoryStore(tmp_path / "store").count() == 0


# ---- the installed `elm` command, a few inputs per surface --------------------------------------


def test_installed_cli_gives_one_line_errors(tmp_path: Path) -> None:
    """The real console script (a subprocess: real argv bytes, real exit codes) on bad input of each
    surface: exit code 2, one `error:` line on stderr, no traceback, no store, no stray file."""
    assert ELM_BIN.exists(), ELM_BIN
    home = tmp_path / "home"
    (tmp_path / "in").mkdir()
    deep = tmp_path / "in" / "deep.yaml"
    deep.write_text("[" * 100_000)
    pickled = tmp_path / "in" / "m.safetensors"
    pickled.write_bytes(pickle.dumps({"soft_prompt": torch.randn(4, HIDDEN)}))
    truncated = tmp_path / "in" / "t.safetensors"
    truncated.write_bytes(BASE_BYTES[: len(BASE_BYTES) // 2])
    store = ["--store", str(tmp_path / "store")]
    cases: list[tuple[list[bytes | str], str]] = [
        (["solve", b"\xff\xfe what?"], "not valid UTF-8"),
        (["solve", " \t "], "question is empty"),
        (["solve", "What is 2+3?", "--namespace", ""], "namespace is empty"),
        (["learn", "What is 2+3?", "-n", "n" * 10_000], "namespace too long"),
        (["config", "show", "--set", "training.steps=" + "9" * 5000], "override"),
        (["config", "show", "--set", "store.path=~nouserxyz/s"], "store.path"),
        (["config", "show", "--config", str(deep)], "not valid YAML"),
        (["memories", "import", str(pickled), *store], "header is"),
        (["memories", "import", str(truncated), *store], "not a safetensors memory file"),
        (["memories", "list", "--store", "~nouserxyz/s"], "cannot expand"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "ELM_DEBUG"} | {"ELM_HOME": str(home), "HOME": str(home)}
    for args, message in cases:
        argv = [os.fsencode(ELM_BIN), *(a if isinstance(a, bytes) else os.fsencode(a) for a in args)]
        with outcome("CLI (subprocess)"):
            res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=120)
            err = res.stderr.decode("utf-8", "replace")
            assert res.returncode == 2, (args[:2], res.returncode, err)
            assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
            assert message in err and b"Traceback" not in res.stdout + res.stderr, err
            TYPED["CLI (subprocess)"] += 1
    assert not (tmp_path / "store").exists()
    assert_only_under(tmp_path, "in")
