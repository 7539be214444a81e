"""The progress display of an evaluation run (online and offline protocols alike).

A run takes minutes to hours on a CPU, so on a terminal it shows a bar with the ETA; in logs
and CI (stderr not a terminal) a bar would be noise, so a run that asks for them gets a plain
line now and then with the time left, and the rest stays silent. ``time_left`` reads the same
from a run's records, for ``elm report`` on a run that is still going.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

#: seconds between two plain progress lines (``lines`` mode)
LINE_SECONDS = 30.0
#: the same for an online run, whose log already has a line per question: these add the time left
STREAM_LINE_SECONDS = 600.0


class ProgressBar:
    """A rich progress bar with ETA on a terminal; silent otherwise. A context manager:
    ``with ProgressBar(None, total=n, completed=done) as bar: bar.describe(...); bar.advance()``."""

    def __init__(
        self,
        enabled: bool | None,
        total: int,
        completed: int,
        *,
        lines: bool = False,
        every: float | None = None,
        phase_lines: bool = True,
    ):
        """``enabled``: None decides by whether stderr is a terminal. ``lines``: where the bar would stay
        silent only because stderr is not a terminal (a log, nohup), print a plain progress line instead on
        each new phase (unless ``phase_lines`` is False) and at most every ``every`` seconds (default
        ``LINE_SECONDS``; for runs whose phases take many minutes)."""
        tty = sys.stderr.isatty()
        self.enabled = tty if enabled is None else enabled
        self.lines = bool(lines) and enabled is None and not tty
        self.every = LINE_SECONDS if every is None else every
        self.phase_lines = phase_lines
        self.total, self.completed = total, completed
        self._bar: Any = None
        self._task: Any = None
        self._started, self._start_count = time.monotonic(), completed
        self._description, self._last_line = "starting", float("-inf")  # the first step prints

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
        if self.lines and text != self._description:
            self._description = text
            if self.phase_lines:
                self._line()

    def advance(self) -> None:
        self.completed += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        if self.lines and time.monotonic() - self._last_line >= self.every:
            self._line()

    def eta_seconds(self) -> float | None:
        """Time left at the pace of this session's steps (None before the first one)."""
        done = self.completed - self._start_count
        if done <= 0:
            return None
        return (time.monotonic() - self._started) / done * max(0, self.total - self.completed)

    def _line(self) -> None:
        self._last_line = time.monotonic()
        eta = self.eta_seconds()
        left = "unknown" if eta is None else duration_text(eta)
        elapsed = duration_text(self._last_line - self._started)
        print(
            f"[progress] {self._description} · {self.completed}/{self.total} steps · {elapsed} elapsed "
            f"· about {left} left",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()


def time_left(records: Sequence[dict[str, Any]], remaining: int, recent: int = 20) -> float | None:
    """Seconds a run's ``remaining`` records would take at the pace of its last ``recent`` ones: the median gap
    between their ``finished_at`` times, so that one stop and resume between them does not count as a record's
    time. None with fewer than two timed records."""
    times = sorted(r["finished_at"] for r in records if isinstance(r.get("finished_at"), int | float))[-recent:]
    if len(times) < 2:
        return None
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False)) * max(0, remaining)


def duration_text(seconds: float) -> str:
    """Minutes up to 90 of them, hours beyond (a stream of a 1.5B model runs for hours)."""
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
