"""Where the memory store lives: one rule for every command and every library entry point.

``ELM_HOME`` is the one root of everything elm-memory keeps on disk:

- set: prepared models in ``$ELM_HOME/models`` and stores in ``$ELM_HOME/<store.path>``;
- unset: models in ``~/.cache/elm-memory/models`` (a cache: rebuilt from the packages when
  deleted) and stores in the user data directory, ``$XDG_DATA_HOME/elm-memory`` (default
  ``~/.local/share/elm-memory``; ``%LOCALAPPDATA%\\elm-memory`` on Windows), because memories
  are learned data that nothing can rebuild.

``store.path`` in a config is resolved by :func:`resolve_store_path`: an absolute path or one
starting with ``~`` is used as given; a relative one names a folder under the data home (the
presets use that: ``store`` for the default model, ``store-tiny`` for SmolLM2), never one under
the current directory, so ``elm learn`` and ``elm memories list`` agree wherever they run.
"""

from __future__ import annotations

import os
from pathlib import Path

from elm_memory.errors import ConfigError

#: ``store.path`` when a config says nothing: ``<data home>/store``.
DEFAULT_STORE = "store"
#: Where versions before this rule kept the default store (named in "no store" errors).
LEGACY_STORE = Path("~/.elm-memory/store")


def data_home() -> Path:
    """``$ELM_HOME`` when set, else the user data directory's ``elm-memory`` folder (absolute)."""
    home = os.environ.get("ELM_HOME")
    if home:
        return Path(home).expanduser().absolute()
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    else:
        xdg = os.environ.get("XDG_DATA_HOME")
        # the XDG spec ignores a relative XDG_DATA_HOME
        base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return (base / "elm-memory").absolute()


def resolve_store_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The absolute store folder for a configured ``store.path`` (see the module docstring).

    ``None`` or ``""`` means the default store, ``<data home>/store``.
    """
    raw = os.fspath(path) if path is not None else ""
    if not raw.strip():
        raw = DEFAULT_STORE
    p = expand_user(Path(raw))
    return p if p.is_absolute() else data_home() / p


def expand_user(path: Path) -> Path:
    """``path`` with ``~`` / ``~user`` expanded; a user this machine does not know is a
    :class:`ConfigError` (a ValueError, so pydantic validators report it too), not a RuntimeError."""
    try:
        return path.expanduser()
    except RuntimeError as exc:
        raise ConfigError(f"cannot expand {str(path)!r}: {exc}") from None
