"""The code on the docs pages listed here runs: each page's Python blocks in order, in one namespace (a page
reads as one session), its YAML blocks load as configs and its TOML blocks parse.

Markers, as HTML comments on the line before a fence (invisible on the built site):
``<!-- fragment -->`` skips the next block (say why beside it); ``<!-- model -->`` marks a Python block
that loads a real packaged model (run only by the test marked ``model``); ``<!-- prints -->`` before a
``text`` block makes it what the Python block before it prints, exactly.
"""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
#: pages whose code runs in full here (add a page once its blocks run or are marked)
PAGES = ["README.md", "docs/using.md", "docs/configuration.md", "docs/agents.md", "docs/stream-memory.md"]

_FENCE = re.compile(r"^(?:<!-- (?P<marker>[a-z]+) -->\n)?```(?P<lang>[a-z]*)[^\n]*\n(?P<body>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    marker: str | None
    line: int


def blocks(text: str) -> list[Block]:
    return [
        Block(m["lang"], m["body"], m["marker"], text.count("\n", 0, m.start("body")) + 1)
        for m in _FENCE.finditer(text)
    ]


def test_the_block_reader_sees_markers_and_languages():
    text = "intro\n```python\nx = 1\n```\n<!-- prints -->\n```text\n1\n```\n<!-- fragment -->\n```python\ny\n```\n"
    assert [(b.lang, b.body, b.marker, b.line) for b in blocks(text)] == [
        ("python", "x = 1\n", None, 3),
        ("text", "1\n", "prints", 7),
        ("python", "y\n", "fragment", 11),
    ]


def run_page(page: str, *, with_model: bool) -> None:
    from elm_memory.config import ELMConfig

    path = ROOT / page
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    printed: str | None = None
    for block in blocks(path.read_text(encoding="utf-8")):
        where = f"{page}:{block.line}"
        if block.marker == "fragment" or (block.marker == "model" and not with_model):
            printed = None
            continue
        if block.marker == "prints":
            if printed is None and not with_model:
                continue  # it shows what a model block printed
            assert printed is not None, f"{where}: a prints block follows no Python block"
            assert printed.strip() == block.body.strip(), f"{where}: the block above prints\n{printed}"
            continue
        if block.lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                # dont_inherit: not this module's `from __future__ import annotations`, under which a page's
                # dataclass would look up its annotations in a module that is not in sys.modules
                exec(compile(block.body, where, "exec", dont_inherit=True), namespace)
            printed = out.getvalue()
        elif block.lang == "yaml":
            data = yaml.safe_load(block.body)
            assert isinstance(data, dict), f"{where}: not a config mapping"
            ELMConfig.from_dict(data)  # a config error names the bad key
        elif block.lang == "toml":
            tomllib.loads(block.body)


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """Memories the pages learn go to a home of their own (the prepared models are shared)."""
    from elm_memory.models.prepare import elm_home

    real = elm_home().resolve()
    for name in ("models", "downloads"):
        (tmp_path / name).symlink_to(real / name, target_is_directory=True)
    monkeypatch.setenv("ELM_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_code_runs(page, fresh_home, monkeypatch):
    from elm_memory.verifiers.registry import verifiers

    monkeypatch.setattr(verifiers, "_entries", dict(verifiers._entries))  # a page's registrations stay there
    run_page(page, with_model=False)


# configuration.md answers two questions on cpu-tiny (SmolLM2-135M): 44 s on 2 busy cores; agents.md
# answers four and learns each: 75-90 s
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_model_code_runs(page, fresh_home, monkeypatch):
    from elm_memory.verifiers.registry import verifiers

    monkeypatch.setattr(verifiers, "_entries", dict(verifiers._entries))
    run_page(page, with_model=True)
