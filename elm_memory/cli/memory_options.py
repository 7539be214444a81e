"""The options every ``elm memories`` command shares: which store, which config, which namespace, JSON or text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

StoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--store", help="Store folder; overrides the config's store.path (see `elm config show`).", show_default=False
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
