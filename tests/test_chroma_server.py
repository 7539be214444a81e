"""Chroma server settings (tenant, database, headers, token) and writes cut to the client's batch limit.

One real ``chroma run`` serves the module (it starts in about a second); each test works in its
own namespaces, so they do not see each other's rows.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _fakes import fake_memory, fake_model_info
from _servers import chroma_server
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.config import ELMConfig, StoreConfig
from elm_memory.errors import ConfigError, StoreError
from elm_memory.store.chroma import ChromaMemoryStore

TENANT, DATABASE = "elm-team", "memories"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``chroma run`` on a free port with tenant ``elm-team`` / database ``memories``; killed by PID after."""
    import chromadb
    from chromadb.config import Settings

    with chroma_server(tmp_path_factory.mktemp("chroma-server")) as url:
        admin = chromadb.AdminClient(
            Settings(
                anonymized_telemetry=False,
                chroma_api_impl="chromadb.api.fastapi.FastAPI",
                chroma_server_host="127.0.0.1",
                chroma_server_http_port=int(url.rsplit(":", 1)[1]),
            )
        )
        admin.create_tenant(TENANT)
        admin.create_database(DATABASE, tenant=TENANT)
        yield url


def _server_store(url: str, root: Path, **kwargs) -> ChromaMemoryStore:
    cfg = StoreConfig(path=str(root), url=url, tenant=TENANT, database=DATABASE)
    return ChromaMemoryStore.from_config(cfg, **kwargs)


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Rows per Collection.upsert/update/delete/get-by-ids call, for every collection in this process."""
    from chromadb.api.models.Collection import Collection

    sizes: dict[str, list[int]] = {"upsert": [], "update": [], "delete": [], "get": []}
    for name in sizes:
        real = getattr(Collection, name)

        def wrapper(self, *args, _real=real, _name=name, **kwargs):
            if kwargs.get("ids") is not None:
                sizes[_name].append(len(kwargs["ids"]))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Collection, name, wrapper)
    return sizes


def test_store_lives_in_the_configured_tenant_and_database(server: str, tmp_path: Path) -> None:
    import chromadb

    info = fake_model_info()
    store = _server_store(server, tmp_path / "blobs", model=info)
    mems = [fake_memory(info, "tenant-ns", seed=i) for i in range(4)]
    store.put_many(mems)
    hit = store.query("input", mems[2].keys["input"], "tenant-ns", k=1)[0]
    assert hit.record.id == mems[2].id and hit.score == pytest.approx(1.0, abs=1e-5)
    assert store.count("tenant-ns") == 4 and torch.equal(store.get(mems[1].id).soft_prompt, mems[1].soft_prompt)
    # the rows are in elm-team/memories, not in the server's default database
    host, port = server.removeprefix("http://").split(":")
    default = chromadb.HttpClient(host=host, port=int(port))
    ours = chromadb.HttpClient(host=host, port=int(port), tenant=TENANT, database=DATABASE)
    assert not any(c.metadata and c.metadata.get("namespace") == "tenant-ns" for c in default.list_collections())
    assert any(c.metadata and c.metadata.get("namespace") == "tenant-ns" for c in ours.list_collections())


@pytest.mark.parametrize(
    ("tenant", "database", "message"),
    [
        ("nobody", DATABASE, "has no tenant 'nobody' (store.tenant)"),
        (TENANT, "nothing", "has no database 'nothing' in tenant 'elm-team' (store.database)"),
    ],
)
def test_missing_tenant_or_database_is_a_one_line_store_error(server, tmp_path, tenant, database, message) -> None:
    with pytest.raises(StoreError) as err:
        ChromaMemoryStore.from_config(StoreConfig(path=str(tmp_path), url=server, tenant=tenant, database=database))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_server_writes_are_cut_to_the_servers_batch_limit(server: str, tmp_path: Path, monkeypatch) -> None:
    """Every write path sends at most max_batch_size rows per request; chromadb itself refuses more."""
    info = fake_model_info()
    store = _server_store(server, tmp_path / "blobs", model=info)
    # the HTTP client asks its server object for the limit, for our chunks and for its own check alike
    monkeypatch.setattr(store.client._server, "get_max_batch_size", lambda: 5)
    assert store._batch_size() == 5
    with pytest.raises(ValueError, match="exceeds maximum batch size 5"):  # what an unchunked write would hit
        store.client.get_or_create_collection("too-big", embedding_function=None).upsert(
            ids=[str(i) for i in range(6)], embeddings=[[1.0, 0.0]] * 6
        )
    sizes = _count_calls(monkeypatch)
    mems = [fake_memory(info, "batched", seed=i) for i in range(12)]
    for m in mems:  # a second, unregistered kind: re-putting without it deletes its rows in bulk
        m.keys["extra"] = torch.randn(3)
    store.put_many(mems)
    assert sizes["upsert"] == [5, 5, 2, 5, 5, 2]  # one collection per kind
    assert store.count("batched", kind="input") == 12 and store.count("batched", kind="extra") == 12
    for m in mems:
        del m.keys["extra"]
    sizes["upsert"].clear()
    store.put_many(mems)  # the lookup of existing ids is chunked too
    assert sizes["upsert"] == [5, 5, 2] and sizes["delete"] == [5, 5, 2]
    assert max(sizes["get"]) <= 5
    assert store.count("batched", kind="extra") == 0
    store.record_usage("input", "batched", [m.id for m in mems])
    assert sizes["update"] == []  # usage is counted in the store's utility table, not in Chroma rows
    assert sum(r.usage for r in store.list("batched")) == 12


def test_embedded_writes_are_cut_to_the_clients_batch_limit(tmp_path: Path, monkeypatch) -> None:
    """PersistentClient has a limit too (5461 in chromadb 1.5.9); chunks follow whatever it reports."""
    info = fake_model_info()
    store = ChromaMemoryStore(tmp_path / "store", model=info)
    assert store._batch_size() == store.client.get_max_batch_size() > 0
    monkeypatch.setattr(store.client, "get_max_batch_size", lambda: 5)
    sizes = _count_calls(monkeypatch)
    mems = [fake_memory(info, "local", seed=i) for i in range(11)]
    store.put_many(mems)
    assert sizes["upsert"] == [5, 5, 1] and store.count("local") == 11
    for m in mems[:7]:  # lose rows behind the store's back: repair rebuilds them (one upsert each)
        store.client.get_collection(store._collections(namespace="local")[0][0].name).delete(ids=[m.id])
    assert store.check(repair=True).reindexed == sorted(m.id for m in mems[:7]) and store.check().ok


def test_cli_import_to_a_server_is_chunked(server: str, tmp_path: Path, monkeypatch) -> None:
    """`elm memories import --url ... --set store.tenant=...` of more memories than one request may carry."""
    from chromadb.api.fastapi import FastAPI

    info = fake_model_info()
    src = tmp_path / "exported"
    src.mkdir()
    files = []
    for i in range(13):
        m = fake_memory(info, "imported", seed=100 + i)
        files.append(str(m.save(src / f"{m.id}.safetensors")))
    monkeypatch.setattr(FastAPI, "get_max_batch_size", lambda self: 4)  # every HTTP client in this process
    sizes = _count_calls(monkeypatch)
    args = [
        "--store",
        str(tmp_path / "blobs"),
        "--url",
        server,
        "--set",
        f"store.tenant={TENANT}",
        "--set",
        f"store.database={DATABASE}",
    ]
    res = CliRunner().invoke(memories_app, ["import", *files, *args, "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["imported"]) == 13 and sizes["upsert"] == [4, 4, 4, 1]
    res = CliRunner().invoke(memories_app, ["list", *args, "--namespace", "imported", "--json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 13


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request 401, keeping its headers: what an auth proxy in front of Chroma sees."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        type(self).seen.append(dict(self.headers))
        body = json.dumps({"error": "AuthError", "message": "Unauthorized"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("header", "sent"), [("Authorization", "Bearer s3cret-token"), ("X-Chroma-Token", "s3cret-token")]
)
def test_headers_and_token_from_the_environment_are_sent(tmp_path, monkeypatch, header, sent) -> None:
    monkeypatch.setenv("ELM_TEST_CHROMA_TOKEN", "s3cret-token")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = StoreConfig(
            path=str(tmp_path),
            url=f"http://127.0.0.1:{httpd.server_address[1]}",
            headers={"X-Team": "research"},
            token_env="ELM_TEST_CHROMA_TOKEN",
            token_header=header,
        )
        with pytest.raises(StoreError, match="refused the credentials") as err:  # one line, no traceback
            ChromaMemoryStore.from_config(cfg)
        assert "\n" not in str(err.value) and "s3cret" not in str(err.value)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert _Recorder.seen, "the client sent nothing"
    got = {k.lower(): v for k, v in _Recorder.seen[0].items()}
    assert got["x-team"] == "research" and got[header.lower()] == sent


def test_token_setting_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("ELM_TEST_CHROMA_TOKEN", raising=False)
    cfg = StoreConfig(path=str(tmp_path), url="http://127.0.0.1:9", token_env="ELM_TEST_CHROMA_TOKEN")
    with pytest.raises(StoreError, match=r"\$ELM_TEST_CHROMA_TOKEN, which is not set"):
        ChromaMemoryStore.from_config(cfg)
    monkeypatch.setenv("ELM_TEST_CHROMA_TOKEN", "t")
    cfg = cfg.model_copy(update={"headers": {"authorization": "Basic x"}})
    with pytest.raises(StoreError, match="store.headers sets Authorization"):
        ChromaMemoryStore.from_config(cfg)


def test_server_settings_need_a_server() -> None:
    with pytest.raises(ConfigError, match="store.tenant applies to a Chroma server"):
        ELMConfig.load(overrides={"store": {"tenant": "elm-team"}})
    with pytest.raises(ConfigError, match="store.token_env"):
        ELMConfig.load(overrides={"store": {"token_env": "not a name"}})
    cfg = ELMConfig.load(overrides={"store": {"url": "http://h:1", "tenant": "t1x", "token_env": "TOK"}})
    got = (cfg.store.tenant, cfg.store.database, cfg.store.token_header)
    assert got == ("t1x", "default_database", "Authorization")
