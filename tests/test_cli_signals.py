"""SIGTERM stops an `elm` command as Ctrl-C does: cleanup runs, exit code 143, one line on stderr."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from elm_memory.cli.errors import handle_errors

# A command wrapped like every `elm` command: it announces itself, then waits in a loop; its `finally`
# writes a marker, which a SIGTERM with Python's default action would never reach.
_COMMAND = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import typer
    from elm_memory.cli.errors import handle_errors

    @handle_errors
    def command(marker: str):
        try:
            print("started", flush=True)
            for _ in range(600):
                time.sleep(0.1)
        finally:
            Path(marker).write_text("cleaned up")

    typer.run(command)
    """
)


def test_sigterm_runs_cleanup_and_exits_143(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMMAND, str(marker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1] == "terminated"
    assert marker.read_text() == "cleaned up"


def test_the_previous_sigterm_handler_comes_back() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    seen = []

    @handle_errors
    def command() -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    try:
        command()
        assert seen and seen[0] is not mine  # the command ran under the library's handler
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_stops_elm_stream_between_questions(tmp_path: Path) -> None:
    """The real command: a stream on the small model, stopped mid-run, exits 143 with its records whole."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "elm_memory.cli", "stream", "--dataset", "synth-arith", "--limit", "200"]
    args += ["-m", "zero_shot", "--preset", "cpu-tiny", "--batch-size", "1", "--no-plots", "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    records = out / "records.jsonl"
    deadline = time.monotonic() + 300
    while not (records.is_file() and records.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "terminated"
    lines = records.read_text().splitlines()
    assert 2 <= len(lines) < 200  # stopped part-way, every recorded line whole
