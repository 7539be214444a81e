"""The ``elm`` command line (console script ``elm = elm_memory.cli:main``; ``python -m elm_memory.cli``).

One package holds every command; nothing below it imports it. Importing a command module registers
its commands on :data:`app`, in the order ``elm --help`` lists them.
"""

from elm_memory.cli import agent, answer, evaluate, settings  # noqa: F401  (they register their commands)
from elm_memory.cli.application import app, main

__all__ = ["app", "main"]
