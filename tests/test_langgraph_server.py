"""The served graphs under a real LangGraph Server (``langgraph dev``), driven by ``langgraph_sdk``.

The server runs the repository's ``langgraph.json`` on 127.0.0.1 with the ``cpu-tiny`` preset
(SmolLM2, one training step) and the scripted chat model for ``math_agent`` (the packaged
0.5B model does not write parseable tool calls; see docs/agents.md); it is stopped by PID.
Next to them it serves a user's own graphs with their own context schema (tests/_served_parent.py).
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
    store = tmp_path_factory.mktemp("served") / "store"
    port = free_port()
    env = {
        **os.environ,
        "ELM_PRESET": "cpu-tiny",
        "ELM_SET": ";".join(
            [
                "model.dtype=float32",
                "generation.max_new_tokens=24",
                "training.steps=1",
                "training.num_generations=2",
                "training.max_completion_length=24",
                "retrieval.skip_no_consensus=false",
                "namespace_template=user-{user_id}",
                f"store.path={store}",
            ]
        ),
        "ELM_AGENT_MODEL": "elm_memory.integrations.testing:scripted_tool_caller",
    }
    # the repository's langgraph.json, plus a user's graphs with their own context schema
    spec = json.loads((ROOT / "langgraph.json").read_text())
    spec["graphs"].update(
        parent="./tests/_served_parent.py:parent", parent_agent="./tests/_served_parent.py:parent_agent"
    )
    config = store.parent / "langgraph.json"
    config.write_text(json.dumps(spec))
    cmd = [
        console_script("langgraph"),
        "dev",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-browser",
        "--no-reload",
        "--config",
        str(config),
    ]
    url = f"http://127.0.0.1:{port}"
    with running_server(cmd, url + "/ok", store.parent / "server.log", timeout=120, cwd=ROOT, env=env):
        yield {"url": url, "store": store}


def run(coro):
    return asyncio.run(coro)


def test_served_elm_graph_answers_learns_streams_and_isolates_users(server):
    from langgraph_sdk import get_client

    async def scenario():
        client = get_client(url=server["url"])
        thread = await client.threads.create()
        first = await client.runs.wait(
            thread["thread_id"], "elm", input={"question": "What is 2 + 3?"}, context={"user_id": "ada"}
        )
        updates = []
        async for event in client.runs.stream(
            None,
            "elm",
            input={"question": "What is 2 + 4?", "learn": False},
            context={"user_id": "ada"},
            stream_mode="updates",
        ):
            if event.event == "updates":
                updates.append(event.data)
        bob = await client.runs.wait(
            None, "elm", input={"question": "What is 2 + 4?", "learn": False}, context={"user_id": "bob"}
        )
        return first, updates, bob

    first, updates, bob = run(scenario())
    assert first["namespace"] == "user-ada" and first["route"] == "zero_shot" and "response" in first
    assert first["learn_job"]["status"] == "done" and first["gate"]["decision"] == "empty_pool"
    memory_id = first["learn_job"]["memory_id"]
    nodes = [next(iter(u)) for u in updates]
    assert nodes[:3] == ["retrieve", "dual_generate", "route"] and nodes[-1] == "respond"
    retrieved = updates[0]["retrieve"]
    assert retrieved["memory_id"] == memory_id and retrieved["gate"]["decision"] == "used"
    assert bob["namespace"] == "user-bob" and bob["memory_id"] is None  # ada's memory is not bob's


def test_served_graph_refuses_bad_context_with_the_field_named(server):
    from langgraph_sdk import get_client

    async def ask(context):
        client = get_client(url=server["url"])
        with pytest.raises(Exception) as info:
            await client.runs.wait(None, "elm", input={"question": "What is 1 + 1?"}, context=context)
        return str(info.value)

    assert "needs 'user_id'" in run(ask({"learn": True}))
    assert "unknown context key(s) 'colour'" in run(ask({"user_id": "ada", "colour": "red"}))
    assert "Traceback" not in run(ask({"learn": True}))


def test_served_math_agent_calls_elm_in_the_users_namespace(server):
    from langgraph_sdk import get_client

    async def scenario():
        client = get_client(url=server["url"])
        return await client.runs.wait(
            None,
            "math_agent",
            input={"messages": [{"role": "user", "content": "What is 2 + 5?"}]},
            context={"user_id": "cy"},
        )

    out = run(scenario())
    kinds = [m["type"] for m in out["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"] and out["messages"][1]["tool_calls"][0]["name"] == "solve_math"
    assert out["messages"][-1]["content"].startswith("The answer is")


def test_a_served_parent_with_its_own_context_schema_gives_elm_its_namespace(server):
    from langgraph_sdk import get_client

    context = {"user_id": "dee", "llm": "team-model"}  # the parent's schema: ELM ignores `llm`

    async def scenario():
        client = get_client(url=server["url"])
        solved = await client.runs.wait(
            None, "parent", input={"question": "What is 2 + 6?", "learn": False}, context=context
        )
        asked = await client.runs.wait(
            None, "parent_agent", input={"messages": [{"role": "user", "content": "What is 2 + 7?"}]}, context=context
        )
        return solved, asked

    solved, asked = run(scenario())
    assert solved["namespace"] == "user-dee" and solved["log"] == ["planned"] and "answer" in solved
    kinds = [m["type"] for m in asked["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"]
    assert json.loads(asked["messages"][2]["content"])["namespace"] == "user-dee"


def test_nothing_was_stored_for_refused_runs(server):
    from elm_memory.config import ELMConfig
    from elm_memory.store.chroma import ChromaMemoryStore

    # runs after the others (file order): every namespace the server wrote is accounted for
    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"store": {"path": str(server["store"])}})
    store = ChromaMemoryStore.from_config(cfg.store, model=None)
    assert {ns: store.count(ns) for ns in store.namespaces()} == {"user-ada": 1, "user-cy": 1, "user-dee": 1}
    # the server ran the preset this test asked for (SmolLM2-135M, hidden size 576), not the default model:
    # langgraph dev lets langgraph.json's env override the process environment
    assert {store.load(r).meta.hidden_size for r in store.list()} == {576}


# -- a stream memory behind the server ---------------------------------------------------------
# The repository's `elm` graph and a user's parent graph with its own context schema (tests/_served_stream.py),
# configured only by ELM_<SECTION>__<KEY> variables: cpu-tiny with stream.mode: stream. Each user's namespace
# gets its own stream memory; every answered run updates it once, and the next run, through either graph,
# answers with the version the last one wrote.


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory):
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


def test_each_users_stream_memory_learns_from_every_run_and_serves_the_next(stream_server):
    from langgraph_sdk import get_client

    from elm_memory.store.stream_files import list_streams, stream_root

    async def scenario():
        client = get_client(url=stream_server["url"])
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
    streams = {s["namespace"]: s for s in list_streams(stream_root(stream_server["store"]))}
    assert streams["user-eve"]["version"] == 2 and streams["user-eve"]["updates"] == 2
    assert (streams["user-fay"]["version"], streams["user-fay"]["updates"]) == (0, 0)
