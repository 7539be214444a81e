"""The options every ``elm memories`` command shares (which store, which config, which namespace, JSON or text),
the config they make and the store it opens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from elm_memory.errors import StoreError

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.store.chroma import ChromaMemoryStore

StoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--store", help="Store folder; overrides the config's store.path (see: elm config show).", show_default=False
    ),
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file (its store.* is used).")]
PresetOpt = Annotated[
    str | None, typer.Option("--preset", "-p", help="Named preset, e.g. cpu-tiny (the store its commands use).")
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config value: section.key=value (repeatable).")
]
UrlOpt = Annotated[str | None, typer.Option("--url", help="Chroma server URL (index rows there, blobs in --store).")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def load_config(
    config: Path | None, preset: str | None, sets: list[str] | None, store: Path | None, url: str | None
) -> ELMConfig:
    """The config every other command would use; ``--store`` (a path on this command line, so relative
    to the current directory like any other) and ``--url`` override its ``store`` section."""
    from elm_memory.config import ELMConfig, deep_merge, parse_overrides

    overrides = parse_overrides(sets)
    if store is not None:
        from elm_memory.config.location import expand_user

        overrides = deep_merge(overrides, {"store": {"path": str(expand_user(store).absolute())}})
    if url is not None:
        overrides = deep_merge(overrides, {"store": {"url": url}})
    return ELMConfig.load(config, preset=preset, overrides=overrides)


def open_store(cfg: ELMConfig, *, create: bool = False) -> ChromaMemoryStore:
    """The config's Chroma store; unless ``create``, a :class:`StoreError` where there is none (naming the
    folder an older version used, if memories are there)."""
    from elm_memory.config.location import LEGACY_STORE
    from elm_memory.store.chroma import ChromaMemoryStore

    if cfg.store.kind != "chroma":
        raise StoreError(f"`elm memories` works on a chroma store; the config's store.kind is {cfg.store.kind!r}")
    path = Path(cfg.store.path)
    if cfg.store.url is None and not create and not (path / "chroma").is_dir():
        legacy = LEGACY_STORE.expanduser()
        hint = (
            f"; memories of an older version are in {legacy} (use --store {legacy}, or move it there)"
            if (legacy / "chroma").is_dir() and legacy != path
            else ""
        )
        raise StoreError(
            f"no memory store at {path} (pick one with --preset, --config, --set store.path=... or --store PATH){hint}"
        )
    return ChromaMemoryStore.from_config(cfg.store)
