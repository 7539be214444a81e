"""One error policy for every ``elm`` command: typed errors become one line on stderr and
their exit code; ``ELM_DEBUG=1`` shows the traceback instead. SIGTERM (``kill``, ``docker stop``, a
scheduler's time limit) stops a command as Ctrl-C does: its cleanup runs (an online run leaves queued
learning queued for a resume) and it exits with 143. Without this, SIGTERM ends Python at once."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import typer

from elm_memory.errors import ELMError


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: everything that stops cleanly on Ctrl-C stops cleanly on it."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("terminated (SIGTERM)")


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the command runs (main thread only: Python lets no other
    thread set handlers); the handler before it comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _sigterm_interrupts():
                return fn(*args, **kwargs)
        except Terminated:
            typer.echo("terminated", err=True)
            raise typer.Exit(143) from None
        except ELMError as exc:
            if os.environ.get("ELM_DEBUG"):
                raise
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper
