"""Every code block of the README and the docs pages runs on its own, as a reader would paste it: each Python
block in a fresh namespace (one test per block), each YAML block loads as a config, each TOML block parses.
Other languages (bash, text) are not run.

Markers, as HTML comments on the lines right before a fence (invisible on the built site), one per line:

- ``<!-- fragment: WHY -->``: the block cannot run alone (it needs a running server, say); its test is skipped
  with WHY as the reason (``-ra`` counts them). A Python fragment must still compile.
- ``<!-- model -->``: the block loads a real packaged model; its test is marked ``model`` and ``slow``.
- ``<!-- name: NAME -->`` names a block; ``<!-- continues: NAME -->`` runs that block first, in the same
  namespace (and whatever it continues, in order), then this one. A chain with a model block is a model test.
- ``<!-- prints -->`` before a ``text`` block: exactly what the Python block before it prints.

In a Python block, ``print(...)  # prints TEXT`` says that call prints TEXT, and the test checks it. Any other
comment on a print call's lines fails, so no output the page shows goes unchecked. A block with top-level
``await`` runs in ``asyncio.run``.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import inspect
import io
import re
import sys
import tokenize
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
#: every page: the README and docs/ (results and the lab log included); a page's bash and text blocks cost nothing
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
RUN = ("python", "yaml", "toml")
MARKERS = {"fragment": True, "model": False, "name": True, "continues": True, "prints": False}  # takes a value

_FENCE = re.compile(r"^(?P<markers>(?:<!--[^\n]*-->\n)*)```(?P<lang>[a-z]*)[^\n]*\n(?P<body>.*?)^```$", re.M | re.S)
_MARKER = re.compile(r"<!-- (?P<key>[a-z]+)(?:: (?P<value>[^\n]*?))? -->")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    markers: dict[str, str]  # a marker without a value maps to ""
    line: int  # the body's first line on its page
    page: str = ""
    prints: str | None = None  # the `<!-- prints -->` text block right after it
    problems: tuple[str, ...] = field(default=())  # malformed markers: the block's test fails with them

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str = "") -> list[Block]:
    found: list[Block] = []
    for m in _FENCE.finditer(text):
        markers: dict[str, str] = {}
        problems: list[str] = []
        for comment in m["markers"].splitlines():
            mk = _MARKER.fullmatch(comment)
            if mk is None or mk["key"] not in MARKERS:
                problems.append(f"unknown marker {comment!r} (known: {', '.join(MARKERS)})")
            elif MARKERS[mk["key"]] != (mk["value"] is not None):
                problems.append(f"{comment!r}: " + ("say `: VALUE`" if MARKERS[mk["key"]] else "takes no value"))
            else:
                markers[mk["key"]] = mk["value"] or ""
        line = text.count("\n", 0, m.start("body")) + 1
        found.append(Block(m["lang"], m["body"], markers, line, page, problems=tuple(problems)))
    return found


def page_blocks(page: str) -> list[Block]:
    """A page's blocks, each text block after `<!-- prints -->` attached to the Python block before it."""
    read = blocks((ROOT / page).read_text(encoding="utf-8"), page)
    out: list[Block] = []
    for block in read:
        if "prints" not in block.markers:
            out.append(block)
            continue
        before = out[-1] if out else None
        if block.lang != "text" or before is None or before.lang != "python" or before.prints is not None:
            out.append(
                Block(
                    block.lang, block.body, {}, block.line, page, problems=("a prints block follows no Python block",)
                )
            )
            continue
        out[-1] = Block(before.lang, before.body, before.markers, before.line, page, block.body, before.problems)
    return out


def chain(block: Block, page: list[Block]) -> tuple[list[Block], list[str]]:
    """The blocks to run for ``block``, first to last, and what is wrong with its markers."""
    named = {b.markers["name"]: b for b in page if "name" in b.markers}
    problems = [*block.problems]
    names = [b.markers["name"] for b in page if "name" in b.markers]
    problems += [f"name {n!r} is given twice on the page" for n in set(names) if names.count(n) > 1]
    run = [block]
    while "continues" in run[0].markers and not problems:
        target = named.get(run[0].markers["continues"])
        if target is None or target.line >= run[0].line:
            problems.append(f"{run[0].where}: continues {run[0].markers['continues']!r}, no earlier block of that name")
        elif "fragment" in target.markers or target.lang != "python" or target in run:
            problems.append(f"{run[0].where}: continues {target.where}, which is not a runnable Python block")
        else:
            problems += target.problems
            run.insert(0, target)
    return run, problems


def doc_cases() -> list[object]:
    cases = []
    for page in PAGES:
        found = page_blocks(page)
        for block in found:
            if block.lang not in RUN and not block.problems:
                continue
            run, problems = chain(block, found)
            model = any("model" in b.markers for b in run)
            marks = [pytest.mark.model, pytest.mark.slow] if model else []
            cases.append(pytest.param(run, problems, id=block.where, marks=marks))
    return cases


def test_the_block_reader_sees_markers_and_languages():
    text = (
        "intro\n<!-- name: setup -->\n```python\nx = 1\n```\n<!-- prints -->\n```text\n1\n```\n"
        "<!-- model -->\n<!-- continues: setup -->\n```python\ny\n```\n<!-- fragment: needs a server -->\n"
        "```python\nz\n```\n<!-- fragment -->\n<!-- colour -->\n```bash\nw\n```\n"
    )
    assert [(b.lang, b.body, b.markers, b.line, b.problems) for b in blocks(text)] == [
        ("python", "x = 1\n", {"name": "setup"}, 4, ()),
        ("text", "1\n", {"prints": ""}, 8, ()),
        ("python", "y\n", {"model": "", "continues": "setup"}, 13, ()),
        ("python", "z\n", {"fragment": "needs a server"}, 17, ()),
        (
            "bash",
            "w\n",
            {},
            22,
            (
                "'<!-- fragment -->': say `: VALUE`",
                "unknown marker '<!-- colour -->' (known: fragment, model, name, continues, prints)",
            ),
        ),
    ]


def test_a_continued_chain_runs_in_order_and_a_broken_one_is_named():
    text = (
        "<!-- name: a -->\n```python\na = 1\n```\n<!-- name: b -->\n<!-- continues: a -->\n```python\nb = a\n```\n"
        "<!-- continues: b -->\n```python\nprint(b)\n```\n<!-- continues: later -->\n```python\nc\n```\n"
        "<!-- name: later -->\n```python\nd\n```\n"
    )
    page = blocks(text, "p.md")
    run, problems = chain(page[2], page)
    assert [b.line for b in run] == [3, 8, 12] and problems == []
    assert chain(page[3], page)[1] == ["p.md:16: continues 'later', no earlier block of that name"]


def prints_comments(body: str) -> tuple[dict[tuple[int, int], str], list[str]]:
    """``# prints TEXT`` on a print call: ``{(first line, last line) of the call: TEXT}``, and any other
    comment on a print call's lines."""
    calls = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(body))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]
    promised: dict[tuple[int, int], str] = {}
    problems: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(body).readline):
        if tok.type != tokenize.COMMENT:
            continue
        span = next((c for c in calls if c[0] <= tok.start[0] <= c[1]), None)
        if span is None:
            continue
        text = tok.string[1:].strip()
        if text.startswith("prints "):
            promised[span] = text.removeprefix("prints ")
        else:
            problems.append(
                f"line {tok.start[0]}: a comment on a print call says `# prints WHAT IT PRINTS`: {tok.string}"
            )
    return promised, problems


def run_python(block: Block, namespace: dict[str, object], *, check: bool) -> None:
    where = block.where
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    # dont_inherit: not this module's `from __future__ import annotations`, under which a page's dataclass
    # would look up its annotations in a module that is not in sys.modules
    code = compile(block.body, where, "exec", flags=flags, dont_inherit=True)
    promised, problems = prints_comments(block.body)
    assert not problems, f"{where}: " + "; ".join(problems)
    said: dict[tuple[int, int], list[str]] = {span: [] for span in promised}

    def recording_print(*args: object, sep: str | None = " ", end: str | None = "\n", **kw: object) -> None:
        frame = sys._getframe(1)
        if frame.f_code.co_filename == where and kw.get("file") is None:
            for (first, last), lines in said.items():
                if first <= frame.f_lineno <= last:
                    lines.append((sep if sep is not None else " ").join(map(str, args)))
        builtins.print(*args, sep=sep, end=end, **kw)  # type: ignore[call-overload]

    namespace["print"] = recording_print
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if code.co_flags & inspect.CO_COROUTINE:  # top-level await: as a notebook runs it
            asyncio.run(eval(code, namespace))
        else:
            exec(code, namespace)
    del namespace["print"]
    if not check:
        return
    for span, text in promised.items():
        got = "\n".join(said[span])
        assert got == text, f"{where}: line {span[0]} promises `# prints {text}` but printed {got!r}"
    if block.prints is not None:
        printed = out.getvalue()
        assert printed.strip() == block.prints.strip(), f"{where}: the block prints\n{printed}"


def close_elms(namespace: dict[str, object]) -> None:
    from elm_memory import ELM

    for value in namespace.values():
        if isinstance(value, ELM):
            value.close()


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """Memories the pages learn go to a home of their own (the prepared models are shared)."""
    from elm_memory.models.prepare import elm_home

    real = elm_home().resolve()
    for name in ("models", "downloads"):
        (tmp_path / name).symlink_to(real / name, target_is_directory=True)
    monkeypatch.setenv("ELM_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)


# Model blocks, 2 cores shared with other work: cpu-tiny (SmolLM2-135M) 51 s for agents.md's first block, which the
# two continuing it run again (104 s and 203 s with theirs), 176 s for configuration.md's; cpu-demo's take minutes
@pytest.mark.parametrize(("run", "problems"), doc_cases())
def test_the_block_runs_alone(run, problems, fresh_home, monkeypatch):
    from elm_memory.config import ELMConfig
    from elm_memory.verifiers.registry import verifiers

    assert not problems, "; ".join(problems)
    block = run[-1]
    if "fragment" in block.markers:
        if block.lang == "python":
            compile(block.body, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        pytest.skip(f"fragment: {block.markers['fragment']}")
    if block.lang == "yaml":
        data = yaml.safe_load(block.body)
        assert isinstance(data, dict), f"{block.where}: not a config mapping"
        ELMConfig.from_dict(data)  # a config error names the bad key
        return
    if block.lang == "toml":
        tomllib.loads(block.body)
        return
    monkeypatch.setattr(verifiers, "_entries", dict(verifiers._entries))  # a block's registrations stay there
    namespace: dict[str, object] = {"__name__": "docs_block"}
    try:
        for step in run:
            run_python(step, namespace, check=step is block)
    finally:
        close_elms(namespace)


def test_a_print_promise_is_checked():
    ok = Block("python", "x = [1]\nprint(x)  # prints [1]\nprint(\n    'a', 'b'\n)  # prints a b\n", {}, 1, "p.md")
    run_python(ok, {"__name__": "docs_block"}, check=True)
    wrong = Block("python", "print(2)  # prints 3\n", {}, 1, "p.md")
    with pytest.raises(AssertionError, match=r"promises `# prints 3` but printed '2'"):
        run_python(wrong, {"__name__": "docs_block"}, check=True)
    vague = Block("python", "print(2)  # 2\n", {}, 1, "p.md")
    with pytest.raises(AssertionError, match="says `# prints WHAT IT PRINTS`"):
        run_python(vague, {"__name__": "docs_block"}, check=True)
    awaited = Block("python", "import asyncio\nawait asyncio.sleep(0)\nprint('done')\n", {}, 1, "p.md", "done\n")
    run_python(awaited, {"__name__": "docs_block"}, check=True)
