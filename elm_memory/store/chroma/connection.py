"""Opening a Chroma client: the embedded database in the store folder, or a Chroma server.

With ``store.url`` the index rows live in a Chroma server (``chroma run``; the scale-out
path) and the blobs stay in the local/shared folder. The server's tenant and database must
exist (the store creates only collections); headers and a static token (read from an
environment variable, sent as chromadb's token auth does) authenticate the client.

Also here: :func:`chroma_errors`, which turns whatever chromadb or its HTTP layer raises
into one-line :class:`~elm_memory.errors.StoreError` messages.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from elm_memory.errors import ELMError, StoreError

#: chromadb's DEFAULT_TENANT / DEFAULT_DATABASE (here so importing this module needs no chromadb)
DEFAULT_TENANT = "default_tenant"
DEFAULT_DATABASE = "default_database"


@contextmanager
def chroma_errors(action: str) -> Iterator[None]:
    """Chroma/HTTP exceptions -> one-line StoreError; our own typed errors pass through."""
    try:
        yield
    except ELMError:
        raise
    except Exception as exc:  # chromadb raises its own, httpx and ValueError types
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"memory store: {action} failed: {msg}") from None


def connect(
    root: Path,
    url: str | None = None,
    *,
    tenant: str = DEFAULT_TENANT,
    database: str = DEFAULT_DATABASE,
    headers: Mapping[str, str] | None = None,
    token_env: str | None = None,
    token_header: str = "Authorization",
) -> Any:
    """A chromadb client: a server's when ``url`` is set, else the embedded one under ``root/chroma``."""
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if url:
        return _connect_server(settings, url, tenant, database, dict(headers or {}), token_env, token_header)
    if (tenant, database) != (DEFAULT_TENANT, DEFAULT_DATABASE) or headers or token_env:
        raise StoreError("store.tenant, database, headers and token_env apply to a Chroma server: set store.url")
    try:
        (root / "chroma").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the memory store at {root}: {exc.strerror or exc}") from None
    with chroma_errors(f"opening the store at {root}"):
        return chromadb.PersistentClient(path=str(root / "chroma"), settings=settings)


def _use_token(settings: Any, headers: Mapping[str, str], token_env: str, token_header: str) -> None:
    """Configure chromadb's own token auth with the token in ``$token_env``."""
    token = os.environ.get(token_env, "")
    if not token:
        raise StoreError(f"store.token_env names ${token_env}, which is not set (or empty)")
    if token_header.lower() in {h.lower() for h in headers}:
        raise StoreError(f"store.headers sets {token_header}, which the token from store.token_env uses")
    # chromadb's own token auth: it formats the header (Bearer or X-Chroma-Token) and keeps
    # the token in a SecretStr, out of reprs and logs
    settings.chroma_client_auth_provider = "chromadb.auth.token_authn.TokenAuthClientProvider"
    settings.chroma_client_auth_credentials = token
    settings.chroma_auth_token_transport_header = token_header


def _connect_server(
    settings: Any,
    url: str,
    tenant: str,
    database: str,
    headers: dict[str, str],
    token_env: str | None,
    token_header: str,
) -> Any:
    import chromadb
    import chromadb.errors

    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StoreError(f"store.url {url!r} is not an http(s)://host:port URL")
    port = parts.port or (443 if parts.scheme == "https" else 8000)
    if token_env:
        _use_token(settings, headers, token_env, token_header)
    where = f"the Chroma server at {url}"
    with chroma_errors(f"connecting to {where}"):
        try:
            # the constructor looks the tenant and database up: a missing one fails here, not at first use
            return chromadb.HttpClient(
                host=parts.hostname,
                port=port,
                ssl=parts.scheme == "https",
                headers=dict(headers) or None,  # a copy: chromadb adds its own to the dict it gets
                settings=settings,
                tenant=tenant,
                database=database,
            )
        except chromadb.errors.NotFoundError as exc:  # "Tenant [x] not found" / "Database [y] not found..."
            if str(exc).lower().startswith("tenant"):
                missing = f"tenant {tenant!r} (store.tenant)"
            else:
                missing = f"database {database!r} in tenant {tenant!r} (store.database)"
            raise StoreError(f"{where} has no {missing}; create it with chromadb's AdminClient") from None
        except (chromadb.errors.ChromaAuthError, chromadb.errors.AuthorizationError) as exc:
            raise StoreError(
                f"{where} refused the credentials ({exc}); check store.token_env, store.token_header and store.headers"
            ) from None
