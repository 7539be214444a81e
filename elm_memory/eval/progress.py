"""The progress display of an evaluation run (online and offline protocols alike).

A run takes minutes to hours on a CPU, so on a terminal it shows a bar with the ETA; in logs
and CI (stderr not a terminal) it stays silent, so records and tables are what a reader sees.
"""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    """A rich progress bar with ETA on a terminal; silent otherwise. A context manager:
    ``with ProgressBar(None, total=n, completed=done) as bar: bar.describe(...); bar.advance()``."""

    def __init__(self, enabled: bool | None, total: int, completed: int):
        """``enabled``: None decides by whether stderr is a terminal."""
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.completed = total, completed
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("starting", total=self.total, completed=self.completed)
        return self

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
