"""A stream memory behind a real LangGraph Server (``langgraph dev``), driven by ``langgraph_sdk``.

The server runs the repository's ``elm`` graph and a user's parent graph with its own context schema
(tests/_served_stream.py), configured by ``ELM_<SECTION>__<KEY>`` variables: ``cpu-tiny`` with
``stream.mode: stream``. Each user's namespace gets its own stream memory; every answered question updates it
once, and the next run, through either graph, answers with the version the last one wrote.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from _servers import console_script, free_port, running_server

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("langgraph_sdk", reason="needs the dev extra (langgraph-sdk)")
pytest.importorskip("langgraph_cli", reason="needs the dev extra (langgraph-cli[inmem])")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("served_stream") / "store"
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("ELM_") or name == "ELM_HOME"}
    env |= {
        "ELM_PRESET": "cpu-tiny",
        "ELM_MODEL__DTYPE": "float32",
        "ELM_BACKEND__NAME": "boxed-answers",  # registered by tests/_served_stream.py
        "ELM_VERIFIER__NAME": "consistency",
        "ELM_VERIFIER__CONSISTENCY_SAMPLES": "3",
        "ELM_STREAM__MODE": "stream",
        "ELM_STREAM__OBJECTIVE": "sft",
        "ELM_NAMESPACE_TEMPLATE": "user-{user_id}",
        "ELM_STORE__PATH": str(store),
    }
    spec = json.loads((ROOT / "langgraph.json").read_text())
    spec["graphs"]["study"] = "./tests/_served_stream.py:study"
    config = store.parent / "langgraph.json"
    config.write_text(json.dumps(spec))
    cmd = [console_script("langgraph"), "dev", "--host", "127.0.0.1", "--port", str(port), "--no-browser"]
    cmd += ["--no-reload", "--config", str(config)]
    url = f"http://127.0.0.1:{port}"
    with running_server(cmd, url + "/ok", store.parent / "server.log", timeout=120, cwd=ROOT, env=env):
        yield {"url": url, "store": store}


def test_each_users_stream_memory_learns_from_every_run_and_serves_the_next(server):
    from langgraph_sdk import get_client

    from elm_memory.store.stream_files import list_streams, stream_root

    async def scenario():
        client = get_client(url=server["url"])
        context = {"user_id": "eve", "course": "algebra"}  # the parent's schema; ELM ignores `course`
        first = await client.runs.wait(None, "study", input={"question": "What is 2 + 3?"}, context=context)
        second = await client.runs.wait(None, "elm", input={"question": "What is 1 + 4?"}, context={"user_id": "eve"})
        asked = await client.runs.wait(
            None, "elm", input={"question": "What is 2 + 3?", "learn": False}, context={"user_id": "fay"}
        )
        return first, second, asked

    first, second, asked = asyncio.run(scenario())
    assert first["log"] == ["planned"] and first["namespace"] == "user-eve" and first["answer"] == "5"
    update = first.get("stream_update") or {}
    assert update, f"no stream update; warnings: {first.get('warnings')}"
    assert update["namespace"] == "user-eve" and update["applied"]
    assert (update["version_used"], update["version"]) == (0, 1)
    # the next run, through the repository's graph, answered with the version the parent's run wrote
    assert second["route"] == "vote" and [c["kind"] for c in second["candidates"]] == ["zero_shot", "stream"]
    assert (second["stream_update"]["version_used"], second["stream_update"]["version"]) == (1, 2)
    # another user answers from their own stream memory's init, and learn=False leaves it there
    assert asked["namespace"] == "user-fay" and asked.get("stream_update") is None and asked["answer"] == "5"
    streams = {s["namespace"]: s for s in list_streams(stream_root(server["store"]))}
    assert streams["user-eve"]["version"] == 2 and streams["user-eve"]["updates"] == 2
    assert (streams["user-fay"]["version"], streams["user-fay"]["updates"]) == (0, 0)
