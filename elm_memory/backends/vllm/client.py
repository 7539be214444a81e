"""JSON over HTTP to a vLLM server: one pooled, thread-safe client with bearer auth and bounded retries.

Needs no vllm install (httpx only), so it runs in the main environment against a server in a
vllm environment. Why httpx and not the ``openai`` client: half of each request is vLLM-only
(``prompt_embeds`` without a ``prompt``, ``vllm_xargs``, ``return_token_ids``, ``top_k``) and so is
the answer's ``token_ids``; with ``openai`` all of that goes through ``extra_body``/``model_extra``
around a dummy prompt. httpx sends the JSON as it is and gives the pooled, thread-safe connections.

Connections: one pooled ``httpx.Client`` (keep-alive, at most ``max_connections``), closed by
:meth:`ServerClient.close`. Authentication: ``api_key`` (config ``backend.server_api_key``), else
``$ELM_VLLM_API_KEY``, else ``$VLLM_API_KEY`` (the variable the server reads for its own
``--api-key``), sent as ``Authorization: Bearer KEY``. Retries: refused or dropped connections,
HTTP 429 and 5xx are retried ``max_retries`` times, waiting ``retry_backoff`` x 2^attempt seconds
(with jitter, at least ``Retry-After``, at most :data:`MAX_BACKOFF`); a request that times out is
not retried (the server may still be working on it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from elm_memory.errors import BackendError

#: Environment variables read for the API key when none is given, in order.
API_KEY_ENVS = ("ELM_VLLM_API_KEY", "VLLM_API_KEY")
#: HTTP statuses worth another try: rate limited, or the server (or a proxy before it) failing.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Longest wait between two attempts, in seconds.
MAX_BACKOFF = 30.0

logger = logging.getLogger(__name__)


class ServerUnavailableError(BackendError):
    """The vLLM server could not be reached (refused, DNS, reset) or did not become healthy."""


class ServerTimeoutError(BackendError):
    """The vLLM server did not answer within the timeout."""


class ServerRequestError(BackendError):
    """The vLLM server answered with an HTTP error or an unexpected body."""


def resolve_api_key(api_key: str | None = None) -> str | None:
    """``api_key`` if given, else the first of :data:`API_KEY_ENVS` that is set and non-empty, else None."""
    if api_key:
        return api_key
    return next((os.environ[n] for n in API_KEY_ENVS if os.environ.get(n)), None)


class ServerClient:
    """JSON over one pooled ``httpx.Client``: keep-alive connections, bearer auth, bounded retries
    with exponential backoff, errors as :class:`ServerUnavailableError` /
    :class:`ServerTimeoutError` / :class:`ServerRequestError`. Safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 16,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.max_retries = max(0, int(max_retries))
        self.retry_backoff = max(0.0, float(retry_backoff))
        self.timeout = timeout
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # At most one request per pooled connection at a time: with more threads than connections
        # waiting inside httpcore's sync pool (1.0.9), requests failed with EBADF ReadErrors here.
        self._slots = threading.BoundedSemaphore(max(1, max_connections))
        self._httpx = httpx
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send one request (retried as configured) and return the decoded JSON body (text if not JSON)."""
        if self._client.is_closed:
            raise BackendError("this vLLM server client was closed")
        httpx = self._httpx
        url = f"{self.base_url}{path}"
        retries = self.max_retries if retries is None else retries
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        for attempt in range(retries + 1):
            last = attempt == retries
            try:
                with self._slots:
                    resp = self._client.request(method, path, json=body, **extra)
            except httpx.ConnectTimeout as exc:  # nothing was sent: safe to try again
                if not last:
                    self._wait(attempt, retries, None, f"{method} {url}: {exc!r}")
                    continue
                raise ServerUnavailableError(f"cannot reach the vLLM server at {url}: connect timed out") from None
            except httpx.TimeoutException:
                limit = self.timeout if timeout is None else timeout
                raise ServerTimeoutError(f"vLLM server {method} {url} did not answer within {limit:g} s") from None
            except httpx.TransportError as exc:  # refused, reset, keep-alive connection dropped
                if not last:
                    self._wait(attempt, retries, None, f"{method} {url}: {exc!r}")
                    continue
                raise ServerUnavailableError(f"cannot reach the vLLM server at {url}: {exc}") from None
            if resp.status_code in RETRY_STATUSES and not last:
                what = f"{method} {url}: HTTP {resp.status_code}"
                self._wait(attempt, retries, resp.headers.get("retry-after"), what)
                continue
            if resp.status_code >= 400:
                raise ServerRequestError(
                    f"vLLM server {method} {url} -> HTTP {resp.status_code}: {_error_detail(resp.text)[:500]}"
                )
            if not resp.content:
                return None
            try:
                return resp.json()
            except ValueError:
                return resp.text
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _wait(self, attempt: int, retries: int, retry_after: str | None, what: str) -> None:
        delay = self.retry_backoff * 2**attempt
        delay = delay / 2 + random.uniform(0, delay / 2)  # jitter: concurrent requests do not retry in step
        with contextlib.suppress(ValueError):  # an HTTP date: the exponential delay stands
            delay = max(delay, float(retry_after)) if retry_after else delay
        delay = min(delay, MAX_BACKOFF)
        logger.warning("vLLM server %s; retry %d/%d in %.2f s", what, attempt + 1, retries, delay)
        self._sleep(delay)

    def close(self) -> None:
        self._client.close()


def _error_detail(text: str) -> str:
    try:
        err = json.loads(text).get("error", text)
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return text


def server_version(client: ServerClient, timeout: float = 10.0) -> str | None:
    """The server's vLLM version from ``GET /version``, or None where that route is missing."""
    try:
        answer = client.request("GET", "/version", timeout=timeout)
    except ServerRequestError:
        return None
    version = answer.get("version") if isinstance(answer, dict) else None
    return str(version) if version else None
