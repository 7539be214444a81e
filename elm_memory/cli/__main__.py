"""``python -m elm_memory.cli``: the ``elm`` command."""

from elm_memory.cli import main

main()
