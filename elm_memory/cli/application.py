"""The ``elm`` command line.

Every command that runs the model takes ``--config FILE``, ``--preset NAME``,
``--namespace NS``, ``--set section.key=value`` and ``--json``. Errors print one
line (``error: ...``) and exit non-zero; ``ELM_DEBUG=1`` shows the traceback.

This module holds the Typer apps and :func:`main`; the commands register themselves on them from
their own modules (:mod:`.answer`, :mod:`.evaluate`, :mod:`.settings`, :mod:`.memories`,
:mod:`.learner`), each importing what it runs only when it runs.
"""

from __future__ import annotations

import os
import sys

import typer

from elm_memory.cli.learner import learner_app
from elm_memory.cli.memories import memories_app

app = typer.Typer(
    name="elm",
    help="Experiential Latent Memory: answer questions and learn reusable latent memories from test-time compute.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Packaged models: list and prepare (GGUF -> safetensors, once).", no_args_is_help=True)
config_app = typer.Typer(help="Show the effective configuration and the presets.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(config_app, name="config")
app.add_typer(memories_app, name="memories")
app.add_typer(learner_app, name="learner")


def _show_model_placement() -> None:
    """One stderr line when a model loads: device, dtype, threads and why (the speed-deciding facts)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("elm: %(message)s"))
    log = logging.getLogger("elm_memory.models.loading")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main() -> None:
    # Offline by default: weights come from packaged models or local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display is the one users read
    _show_model_placement()
    try:
        app()
    except BrokenPipeError:  # `elm ... | head`
        sys.exit(1)
