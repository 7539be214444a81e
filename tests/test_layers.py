"""Imports point down the layers of ``shared/DESIGN.md`` ("Layers"), never up, and packages form no cycle.

An AST check in the style of ``test_packaging.py``: every ``import`` in the installed tree counts,
including those under ``if TYPE_CHECKING:`` and inside functions, and so does a registry's
``"elm_memory.pkg.mod:Attr"`` string (a lookup by name is an import that happens later).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elm_memory.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500

# Lowest first. A module belongs to the longest prefix of its dotted name listed here (so a single
# module can sit above or below the rest of its package); a module may import its own layer or below.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "elm_memory.errors",
        "elm_memory.atomic",
        "elm_memory.processes",
        "elm_memory.faults",
        "elm_memory.hardware",
        "elm_memory.environment",
        "elm_memory.answers",
    ),
    ("elm_memory.config", "elm_memory.data", "elm_memory.plugins", "elm_memory.presets"),
    ("elm_memory.models",),
    ("elm_memory.memory",),
    ("elm_memory.backends", "elm_memory.jobs"),
    ("elm_memory.verifiers", "elm_memory.store"),
    ("elm_memory.retrieval",),
    ("elm_memory.training", "elm_memory.graph"),
    ("elm_memory.elm",),
    ("elm_memory.eval", "elm_memory.integrations", "elm_memory.graphs"),
    ("elm_memory.cli",),
    # the package root (its lazy ``ELM``, the config's name check) and the old import paths kept for one
    # release: above everything, so nothing in the package may import them
    ("elm_memory", "elm_memory.moved", "elm_memory.registry", "elm_memory.memories", *MOVED),
)
LAYER_OF = {prefix: number for number, prefixes in enumerate(LAYERS, start=1) for prefix in prefixes}


def layer(module: str) -> tuple[str, int]:
    """The listed prefix ``module`` falls under and its layer number (KeyError: an unlisted package)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYER_OF and (end > 1 or len(parts) == 1):  # the root's layer is its own, not a default
            return prefix, LAYER_OF[prefix]
    raise KeyError(module)


def package(module: str) -> str:
    """The unit cycles are counted between: ``elm_memory.X`` (``elm_memory`` for its own ``__init__``)."""
    return ".".join(module.split(".")[:2])


def source_files() -> dict[str, Path]:
    """Dotted module name -> file, for everything the wheel installs (``package-dir`` of pyproject)."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"elm_memory": ROOT / "elm_memory"}
    roots.update({name: ROOT / folder for name, folder in conf["package-dir"].items() if name})
    modules: dict[str, Path] = {}
    for name, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = path
    return modules


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    module: str
    target: str

    def __str__(self) -> str:
        (_, low), (_, high) = layer(self.module), layer(self.target)
        where = self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file
        return f"{where}:{self.line} {self.module} -> {self.target} (layer {low} -> layer {high})"


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The deepest module of ours that ``name`` (``pkg.mod`` or ``pkg.mod.attr``) names."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every import of one of our modules that ``path`` makes, wherever in the file it stands."""
    is_package = path.name == "__init__.py"
    seen: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            # a registry entry "elm_memory.pkg.mod:Attr": imported by name when looked up
            if value.startswith("elm_memory.") and ":" in value and " " not in value:
                names = [value.partition(":")[0]]
        for name in names:
            if name == "elm_memory" or name.startswith("elm_memory."):
                target = _resolve(name, known)
                if (node.lineno, target) not in seen:  # `from m import a, b` is one import of m
                    seen.add((node.lineno, target))
                    yield Import(path, node.lineno, module, target)


def all_imports() -> list[Import]:
    files = source_files()
    known = {**files, **{old: Path(old) for old in MOVED}}  # an old path is a module of its own here
    return [found for module, path in sorted(files.items()) for found in imports(module, path, known)]


def upward_imports(found: list[Import]) -> list[Import]:
    return [i for i in found if layer(i.target)[1] > layer(i.module)[1]]


def package_cycles(found: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one package (Tarjan), each sorted."""
    edges: dict[str, set[str]] = {}
    for i in found:
        src, dst = package(i.module), package(i.target)
        edges.setdefault(src, set())
        edges.setdefault(dst, set())
        if src != dst:
            edges[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(groups)


def cycle_report(found: list[Import], group: list[str]) -> str:
    """One cycle group with the imports that close it (those not pointing down: a cycle has at least
    one), so the line to change is in the message."""
    members = set(group)
    ties = [
        str(i)
        for i in found
        if package(i.module) in members
        and package(i.target) in members
        and package(i.module) != package(i.target)
        and layer(i.target)[1] >= layer(i.module)[1]
    ]
    if not ties:  # every arrow points down by module, so a module sits above the rest of its package
        ties = [
            str(i)
            for i in found
            if package(i.module) in members
            and package(i.target) in members
            and package(i.module) != package(i.target)
            and layer(i.module)[1] != layer(package(i.module))[1]
        ]
    return "cycle between " + ", ".join(group) + ":\n    " + "\n    ".join(ties)


def test_every_module_has_a_layer():
    unplaced = []
    for module in source_files():
        try:
            layer(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, "modules with no layer in LAYERS: " + ", ".join(unplaced)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    # an upward import hidden three ways (type-only, in a function, as a registry string) is still seen
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from elm_memory.elm import ELM\n"
        "def f():\n"
        "    from ..store import base\n"
        "TARGET = 'elm_memory.eval.online:run'\n"
    )
    known = source_files()
    found = list(imports("elm_memory.models.planted", planted, known))
    assert [(i.line, i.target) for i in found] == [
        (3, "elm_memory.elm"),
        (5, "elm_memory.store.base"),
        (6, "elm_memory.eval.online"),
    ]
    assert len(upward_imports(found)) == 3
    assert str(found[0]).endswith("elm_memory.models.planted -> elm_memory.elm (layer 3 -> layer 9)")


def test_imports_point_down_and_packages_form_no_cycle():
    found = all_imports()
    upward = upward_imports(found)
    cycles = package_cycles(found)
    message = [f"{len(upward)} upward imports:", *(f"  {i}" for i in upward)]
    message += [f"{len(cycles)} package cycles:", *(f"  {cycle_report(found, c)}" for c in cycles)]
    assert not upward and not cycles, "\n".join(message)


def test_no_module_is_over_the_line_limit():
    long = {m: n for m, p in source_files().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_old_import_paths_still_import_with_a_warning():
    # one release of grace after the moves (elm_memory/moved.py): the old name is the new module itself
    import importlib
    import sys
    import warnings

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert module.__spec__.name == new  # the alias did not take over the module's identity
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
    with pytest.warns(DeprecationWarning, match="elm_memory.backends.registry"):
        from elm_memory.registry import backends
    from elm_memory.backends.registry import backends as owned

    assert backends is owned


def test_nothing_in_the_package_imports_an_old_path():
    old = set(MOVED) | {"elm_memory.registry", "elm_memory.memories"}
    users = [str(i) for i in all_imports() if i.target in old and i.module not in old | {"elm_memory"}]
    assert not users, "\n".join(users)
