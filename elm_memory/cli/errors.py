"""One error policy for every ``elm`` command: typed errors become one line on stderr and
their exit code; ``ELM_DEBUG=1`` shows the traceback instead."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import Any

import typer

from elm_memory.errors import ELMError


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ELMError as exc:
            if os.environ.get("ELM_DEBUG"):
                raise
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper
