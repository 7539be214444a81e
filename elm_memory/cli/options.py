"""What the ``elm`` commands share: the options every model-running command takes, the config
they make, and a command class that lets a question start with "-".

Kept apart from the commands (``elm_memory/cli.py``) so that each command reads as what it does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

if TYPE_CHECKING:
    from elm_memory.config import ELMConfig
    from elm_memory.config.loading import Layer

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
PresetOpt = Annotated[str | None, typer.Option("--preset", "-p", help="Named preset, e.g. cpu-demo, cpu-tiny.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", "-n", help="Memory namespace.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
BackendOpt = Annotated[
    str | None, typer.Option("--backend", help="Generation backend: hf (default), vllm, vllm-server, or a plugin.")
]
ServerUrlOpt = Annotated[str | None, typer.Option("--server-url", help="vLLM server URL, e.g. http://127.0.0.1:8000.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config value: section.key=value (repeatable).")
]


_OPTION_LIKE = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*(=.*)?", re.DOTALL)


class QuestionCommand(TyperCommand):
    """A command whose question may start with "-": ``elm solve "-3 + 5?"`` answers it.

    Click reads every argument that starts with "-" as an option and stops with a usage
    error. Here an argument that cannot be an option name (a digit, space or punctuation
    after the dash) is taken as the question; ``--`` still ends the options for any other
    question (``elm solve -- "-x"``).
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        takes_value = {  # duck-typed: typer may run on its own vendored copy of click
            name: not (getattr(p, "is_flag", False) or getattr(p, "count", False))
            for p in self.get_params(ctx)
            if getattr(p, "param_type_name", None) == "option"
            for name in (*p.opts, *p.secondary_opts)
        }
        options: list[str] = []
        positional: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                positional += args[i + 1 :]
                break
            if takes_value.get(arg) and i + 1 < len(args):
                options += [arg, args[i + 1]]  # an option's value may itself start with "-"
                i += 2
                continue
            # an option, or a mistyped one that click then reports
            (options if _OPTION_LIKE.fullmatch(arg) else positional).append(arg)
            i += 1
        if any(a.startswith("-") and len(a) > 1 for a in positional):
            args = [*options, "--", *positional]  # options first, questions in their order after "--"
        return super().parse_args(ctx, args)


def config_layers(
    config: Path | None,
    preset: str | None,
    namespace: str | None,
    sets: list[str] | None,
    backend: str | None = None,
    server_url: str | None = None,
) -> list[Layer]:
    """Where a command's config comes from, as ``ELMConfig.load`` layers it: ``--preset``, ``--config``, the
    ``ELM_`` environment variables, then ``--set``, then the dedicated options (``--backend``,
    ``--server-url``, ``--namespace``), which win."""
    from elm_memory.config import ELMConfig, parse_overrides
    from elm_memory.config.loading import Layer
    from elm_memory.config.sources import config_layers

    layers = config_layers(ELMConfig, config, preset=preset, overrides=parse_overrides(sets), overrides_source="--set")
    if backend:
        layers.append(Layer("--backend", {"backend": {"name": backend}}))
    if server_url:
        layers.append(Layer("--server-url", {"backend": {"server_url": server_url}}))
    if namespace is not None:  # "" is an error, not the default namespace
        from elm_memory.memory.ids import validate_namespace

        layers.append(Layer("--namespace", {"namespace": validate_namespace(namespace)}))
    return layers


def load_config(
    config: Path | None,
    preset: str | None,
    namespace: str | None,
    sets: list[str] | None,
    backend: str | None = None,
    server_url: str | None = None,
) -> ELMConfig:
    """The config a command runs with (:func:`config_layers`)."""
    from elm_memory.config import ELMConfig

    return ELMConfig.from_layers(config_layers(config, preset, namespace, sets, backend, server_url))
