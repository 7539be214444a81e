"""The vLLM backends' logic that needs neither vllm nor a GPU: the answer cut after generation,
the choice between the in-engine stop processor and post-processing only (V1 / V2 model runner,
with the runner flag faked), the vLLM version floor for prompt embeds, and the server client's
HTTP behaviour (retries, API key, pooled connections) against a local stdlib HTTP server."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elm_memory.backends.base import SamplingParams
from elm_memory.backends.postprocess import answer_cut, finish_generation
from elm_memory.backends.vllm import common, engine, model_runner
from elm_memory.backends.vllm.client import ServerClient, ServerRequestError, ServerUnavailableError, resolve_api_key
from elm_memory.backends.vllm.launcher import free_port
from elm_memory.errors import BackendError

# -- the answer cut after generation ---------------------------------------------------------


class PieceTokenizer:
    """Token id -> text piece; id 0 is EOS (special)."""

    eos_token_id = 0

    def __init__(self, pieces):
        self.pieces = ["</s>", *pieces]

    def encode(self, text_pieces):
        return [self.pieces.index(p) for p in text_pieces]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))


TOK = PieceTokenizer(["The ", "answer ", "is ", "\\boxed{", "4", "2", "}", ".", " Q:", " next", " {x}"])
ANSWER = TOK.encode(["The ", "answer ", "is ", "\\boxed{", "4", "2", "}"])
TAIL = TOK.encode([".", " Q:", " next", " {x}"])


def test_post_processing_cut_equals_the_in_engine_stop():
    """V1 (processor forces EOS after the closing token) and V2 (no processor: the engine runs on
    to max_tokens) give the same Generation: the cut is applied after generation either way."""
    lps = [-0.1 * (i + 1) for i in range(len(ANSWER) + len(TAIL))]
    v1 = finish_generation(
        TOK, [*ANSWER, 0], [0], stop_at_answer=True, logprobs=lps[: len(ANSWER)] + [-0.01], engine_reason="stop"
    )
    v2 = finish_generation(TOK, ANSWER + TAIL, [0], stop_at_answer=True, logprobs=lps, engine_reason="length")
    assert v1 == v2
    assert v2.finish_reason == "answer" and v2.token_ids == ANSWER and v2.text == "The answer is \\boxed{42}"
    assert v2.logprobs == lps[: len(ANSWER)]
    # Without stop_at_answer nothing is cut; an empty box is not an answer.
    full = finish_generation(TOK, ANSWER + TAIL, [0], stop_at_answer=False)
    assert full.finish_reason == "length" and full.token_ids == ANSWER + TAIL
    empty = TOK.encode(["\\boxed{", "}", " next"])
    assert finish_generation(TOK, empty, [0], stop_at_answer=True).finish_reason == "length"
    assert answer_cut(TOK, TOK.encode(["The ", "\\boxed{", "4", "}", "."])) == 4


# -- in-engine processor or post-processing only ----------------------------------------------


def test_stop_processor_only_with_the_v1_model_runner(caplog):
    caplog.set_level(logging.INFO, logger="elm_memory.backends.vllm.model_runner")
    model_runner._logged_paths.clear()
    v1 = {"model": "m"}
    assert model_runner.select_stop_processor(v1, detect=lambda kw: False) is True
    assert v1["logits_processors"] == [model_runner.LOGITS_PROCESSOR]
    v2 = {"model": "m", "logits_processors": [model_runner.LOGITS_PROCESSOR]}
    assert model_runner.select_stop_processor(v2, detect=lambda kw: True) is False
    assert "logits_processors" not in v2  # V2 would refuse the V1-interface class at start-up
    mine = {"logits_processors": ["pkg:MyV2Processor"]}
    assert model_runner.select_stop_processor(mine, detect=lambda kw: True) is False
    assert mine["logits_processors"] == ["pkg:MyV2Processor"]  # a caller's own processors stay

    def broken(kw):
        raise RuntimeError("no config")

    unknown = {"model": "m"}
    assert model_runner.select_stop_processor(unknown, detect=broken) is False  # unknown runner: the safe path
    assert "logits_processors" not in unknown
    model_runner.select_stop_processor({}, detect=lambda kw: True)
    msgs = [r.getMessage() for r in caplog.records if r.name == "elm_memory.backends.vllm.model_runner"]
    assert sum("post-processing only" in m for m in msgs) == 1  # logged once per path
    assert sum("in-engine logits processor" in m for m in msgs) == 1


def _fake_vllm(monkeypatch, version="0.32.0", v2=False, llm=None):
    """A stand-in ``vllm`` package: version, EngineArgs whose config carries the runner flag, LLM."""

    @dataclasses.dataclass
    class EngineArgs:
        model: str = ""
        tokenizer: str | None = None
        dtype: str = "auto"
        seed: int = 0

        def create_engine_config(self):
            return types.SimpleNamespace(use_v2_model_runner=v2)

    root = types.ModuleType("vllm")
    root.__version__ = version
    root.LLM = llm
    root.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    for name, mod in (("vllm", root), ("vllm.engine", engine), ("vllm.engine.arg_utils", arg_utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    return root


@pytest.mark.parametrize("flag", [True, False])
def test_runner_detection_reads_the_engine_configs_flag(monkeypatch, flag):
    _fake_vllm(monkeypatch, v2=flag)
    kwargs = {"model": "m", "dtype": "float32", "logits_processors": ["x:y"], "not_an_engine_arg": 1}
    assert model_runner.uses_v2_model_runner(kwargs) is flag
    assert model_runner.v2_runner_from_engine_config(object()) is False  # vLLM before the V2 runner: V1


@pytest.mark.model
def test_v2_engine_starts_without_the_processor_and_answers_are_cut(monkeypatch, tiny_loaded):
    """The offline backend on a faked V2-runner vLLM: no logits processor, no stop xarg, and the
    continuation past the closed box (what V2 returns) is cut with finish_reason "answer"."""
    tok = tiny_loaded.tokenizer
    answer = tok(" \\boxed{8}", add_special_tokens=False)["input_ids"]
    tail = tok("\nQ: 5+5?\nA:", add_special_tokens=False)["input_ids"]
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen["kwargs"] = kwargs

        def generate(self, requests, sps, use_tqdm=False):
            seen["sps"] = sps
            out = types.SimpleNamespace(index=0, token_ids=answer + tail, finish_reason="length", logprobs=None)
            return [types.SimpleNamespace(outputs=[out]) for _ in requests]

    _fake_vllm(monkeypatch, v2=True, llm=FakeLLM)
    backend = engine.VLLMBackend(tiny_loaded.info.path, dtype="float32", loaded=tiny_loaded, device="cpu")
    assert backend.stop_in_engine is False and "logits_processors" not in seen["kwargs"]
    [[gen]] = backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, stop_at_answer=True))
    assert seen["sps"][0].extra_args is None
    assert gen.finish_reason == "answer" and gen.token_ids == answer and gen.text.strip() == "\\boxed{8}"


# -- vLLM version floor for prompt embeds -------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", common.MIN_VLLM_FOR_PROMPT_EMBEDS, "1.0.0"])
def test_vllm_versions_past_the_prompt_embeds_cves_pass(version):
    common.check_prompt_embeds_version(version)


@pytest.mark.parametrize("version", ["0.11.0", "0.11.1", "0.13.0", "0.25.1.dev3+g1234abc", "0.26.0rc1"])
def test_older_vllm_is_refused_naming_both_versions(version):
    with pytest.raises(common.VLLMVersionError) as info:
        common.check_prompt_embeds_version(version)
    msg = str(info.value)
    assert version in msg and common.MIN_VLLM_FOR_PROMPT_EMBEDS in msg and "CVE-2025-62164" in msg
    assert "\n" not in msg and isinstance(info.value, BackendError)
    with pytest.raises(common.VLLMVersionError, match="cannot read"):
        common.check_prompt_embeds_version("not-a-version")


def test_offline_backend_refuses_an_old_vllm_before_anything_else(monkeypatch):
    _fake_vllm(monkeypatch, version="0.11.0")
    with pytest.raises(common.VLLMVersionError, match=r"installed vllm 0\.11\.0 is older than"):
        engine.VLLMBackend("/nonexistent")


# -- the server client: a local HTTP server ------------------------------------------------------


class FakeServer:
    """ThreadingHTTPServer (HTTP/1.1 keep-alive) on 127.0.0.1 that records requests and TCP connections.

    ``fail``: the first ``n`` requests get ``status`` (with ``headers``); ``drop``: the first
    ``n`` requests get the connection closed without an answer; ``key``: required bearer key."""

    def __init__(self, fail=0, status=503, headers=None, drop=0, key=None, version="0.32.0"):
        self.fail, self.status, self.fail_headers, self.drop, self.key = fail, status, headers or {}, drop, key
        self.version = version
        self.requests: list[tuple[str, str, str | None]] = []
        self.connections = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with outer.lock:
                    outer.connections += 1

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self._answer()

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append((self.command, self.path, self.headers.get("Authorization")))
                if n < outer.drop:
                    self.close_connection = True
                    self.connection.shutdown(2)  # no status line at all
                    return
                if n < outer.fail:
                    return self._send(outer.status, {"error": {"message": "busy"}}, outer.fail_headers)
                if outer.key is not None and self.headers.get("Authorization") != f"Bearer {outer.key}":
                    return self._send(401, {"error": "Unauthorized"})
                if self.path == "/version":
                    return self._send(200, {"version": outer.version})
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny", "max_model_len": 512}]})
                if self.path == "/bad":
                    return self._send(400, {"error": {"message": "bad request"}})
                return self._send(200, {"path": self.path, "echo": json.loads(body) if body else None})

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def _client(url, **kw):
    waits: list[float] = []
    kw.setdefault("retry_backoff", 0.5)
    client = ServerClient(url, timeout=10, connect_timeout=5, sleep=waits.append, **kw)
    return client, waits


def test_5xx_is_retried_with_exponential_backoff_then_succeeds():
    with FakeServer(fail=3, status=503) as srv:
        client, waits = _client(srv.url, max_retries=3)
        assert client.request("POST", "/v1/completions", {"a": 1}) == {"path": "/v1/completions", "echo": {"a": 1}}
        client.close()
    assert len(srv.requests) == 4 and len(waits) == 3
    for attempt, wait in enumerate(waits):  # 0.5 * 2^attempt, with jitter in its upper half
        assert 0.25 * 2**attempt <= wait <= 0.5 * 2**attempt


def test_retries_are_bounded_and_the_last_error_is_typed():
    with FakeServer(fail=10, status=502) as srv:
        client, waits = _client(srv.url, max_retries=2)
        with pytest.raises(ServerRequestError, match="HTTP 502: busy"):
            client.request("GET", "/v1/models")
        client.close()
    assert len(srv.requests) == 3 and len(waits) == 2


def test_429_waits_at_least_retry_after_and_4xx_is_not_retried():
    with FakeServer(fail=1, status=429, headers={"Retry-After": "3"}) as srv:
        client, waits = _client(srv.url, max_retries=3, retry_backoff=0.01)
        client.request("GET", "/v1/models")
        assert waits == [3.0]
        with pytest.raises(ServerRequestError, match="HTTP 400: bad request"):
            client.request("GET", "/bad")
        client.close()
    assert len(srv.requests) == 3 and len(waits) == 1


def test_dropped_connections_are_retried():
    with FakeServer(drop=2) as srv:
        client, waits = _client(srv.url, max_retries=2)
        assert client.request("GET", "/health")["path"] == "/health"
        client.close()
    assert len(srv.requests) == 3 and len(waits) == 2


def test_refused_connection_is_retried_then_unavailable():
    client, waits = _client(f"http://127.0.0.1:{free_port()}", max_retries=2)
    with pytest.raises(ServerUnavailableError, match="cannot reach"):
        client.request("GET", "/v1/models")
    assert len(waits) == 2
    client.close()


def test_api_key_is_sent_as_bearer_from_argument_or_environment(monkeypatch):
    for name in ("ELM_VLLM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert resolve_api_key(None) == "from-vllm-env"
    monkeypatch.setenv("ELM_VLLM_API_KEY", "k-123")
    assert resolve_api_key(None) == "k-123" and resolve_api_key("explicit") == "explicit"
    with FakeServer(key="k-123") as srv:
        good, _ = _client(srv.url, api_key=resolve_api_key(None))
        assert good.request("GET", "/v1/models")["data"][0]["id"] == "tiny"
        bad, waits = _client(srv.url, api_key="wrong", max_retries=3)
        with pytest.raises(ServerRequestError, match="HTTP 401"):
            bad.request("GET", "/v1/models")
        good.close()
        bad.close()
    assert waits == []  # 401 is not retried
    assert [r[2] for r in srv.requests] == ["Bearer k-123", "Bearer wrong"]


def test_one_pool_of_keep_alive_connections_per_client_closed_by_close():
    with FakeServer() as srv:
        client, _ = _client(srv.url, max_connections=4)
        for i in range(10):
            client.request("POST", "/v1/completions", {"i": i})
        assert srv.connections == 1  # sequential requests reuse one connection
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda i: client.request("POST", "/v1/completions", {"i": i}), range(40)))
        assert 1 <= srv.connections <= 4  # never more than the pool's limit
        client.close()
        with pytest.raises(BackendError, match="closed"):
            client.request("GET", "/health")
    assert len(srv.requests) == 50


@pytest.mark.model
def test_server_backend_checks_the_version_sends_the_key_and_closes(tiny_loaded, monkeypatch):
    """VLLMServerBackend.from_config against the fake server: the config's key and retry settings
    reach the client, an old server version is refused, close() ends the pool."""
    from elm_memory.backends.vllm.server_backend import VLLMServerBackend
    from elm_memory.config import ELMConfig

    monkeypatch.delenv("ELM_VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    for version, ok in (("0.32.0", True), ("0.11.1", False)):
        with FakeServer(key="cfg-key", fail=1, status=503, version=version) as srv:
            cfg = ELMConfig.load(
                preset="cpu-tiny",
                overrides={
                    "model": {"dtype": "float32"},
                    "backend": {
                        "name": "vllm-server",
                        "server_url": srv.url,
                        "server_api_key": "cfg-key",
                        "server_max_retries": 1,
                        "server_retry_backoff": 0.0,
                    },
                },
            )
            if ok:
                with VLLMServerBackend.from_config(cfg, loaded=tiny_loaded) as backend:
                    assert backend.served_model == "tiny" and backend.server_version == "0.32.0"
                    assert backend.info.max_context == 512 and backend.health()
                assert backend._client._client.is_closed
            else:
                with pytest.raises(common.VLLMVersionError, match=r"the server's .* vllm 0\.11\.1 is older than"):
                    VLLMServerBackend.from_config(cfg, loaded=tiny_loaded)
        assert [r[1] for r in srv.requests[:3]] == ["/v1/models", "/v1/models", "/version"]  # 503 retried
        assert all(r[2] == "Bearer cfg-key" for r in srv.requests)


def test_vllm_backends_say_they_do_not_use_the_hf_lookup_lever(caplog):
    from elm_memory.config import ELMConfig

    with caplog.at_level("WARNING", logger="elm_memory.backends.vllm.common"):
        common.warn_unused_hf_levers(ELMConfig.load(preset="cpu-demo"), "vllm")
    assert "backend.lookup_draft_tokens=3" in caplog.text and "backend 'vllm'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="elm_memory.backends.vllm.common"):
        common.warn_unused_hf_levers(ELMConfig.load(preset="cpu-tiny"), "vllm-server")
    assert caplog.text == ""
