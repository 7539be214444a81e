"""The packaged agent's chat model (``integrations/chat_model.py``): tool calls read from what a model
writes, the chat template's rendering, bounded turns, and ``elm agent`` on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from elm_memory.backends.base import Generation
from elm_memory.integrations.chat_model import ElmChatModel, parse_tool_calls, render_chat

CALL = {"name": "solve_math", "arguments": {"question": "What is 2+3?"}}


@tool
def solve_math(question: str) -> str:
    """Solve a math word problem. Returns JSON with the answer."""
    return json.dumps({"answer": "5"})


@pytest.mark.parametrize(
    "text, content",
    [
        (f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", ""),  # Qwen2.5's tagged format
        (f"Let me solve it.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>", "Let me solve it."),
        (f"<tool_call>\n{json.dumps(CALL)}", ""),  # cut by the token budget before the closing tag
        (json.dumps(CALL), ""),  # plain JSON, as the packaged 0.5B model writes it
        (f"```json\n{json.dumps(CALL)}\n```", ""),
        (json.dumps(CALL)[:-1], ""),  # the 0.5B model often leaves off the last brace
        (json.dumps({"name": "solve_math", "parameters": {"question": "What is 2+3?"}}), ""),
        (json.dumps({"name": "solve_math", "arguments": json.dumps({"question": "What is 2+3?"})}), ""),
        (f"I will call the tool: {json.dumps(CALL)}", "I will call the tool:"),
    ],
)
def test_tool_calls_are_read_from_tagged_and_plain_json(text, content):
    got, calls, invalid = parse_tool_calls(text, ["solve_math"])
    assert got == content and invalid == []
    assert [(c["name"], c["args"]) for c in calls] == [("solve_math", {"question": "What is 2+3?"})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "tool_call"


def test_two_tagged_calls_are_two_calls():
    text = "".join(f"<tool_call>{json.dumps({**CALL, 'arguments': {'question': q}})}</tool_call>" for q in "ab")
    _, calls, _ = parse_tool_calls(text, ["solve_math"])
    assert [c["args"]["question"] for c in calls] == ["a", "b"] and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "text, invalid",
    [
        ('<tool_call>{"name": "solve_math", "arguments": {question: 2+3}}</tool_call>', 1),  # malformed JSON
        ('<tool_call>{"name": "solve_math", "arguments": 5}</tool_call>', 1),  # arguments not an object
        ('<tool_call>{"name": "web_search", "arguments": {}}</tool_call>', 1),  # no such tool
        ('{"name": "solve_math", "arguments": {question: 2+3}}', 0),  # malformed plain JSON: just text
        ('{"name": "solve_math", "arguments": {"question": "unclosed', 0),  # cut inside a string
        ('{"name": "web_search", "arguments": {"q": "x"}}', 0),
        ('The answer is {"value": 5}.', 0),
        ("2 + 3 = 5", 0),
    ],
)
def test_anything_else_is_a_plain_text_answer(text, invalid):
    content, calls, bad = parse_tool_calls(text, ["solve_math"])
    assert calls == [] and content == text.strip() and len(bad) == invalid
    if bad:
        assert bad[0]["error"] and bad[0]["type"] == "invalid_tool_call"


def test_without_bound_tools_json_is_text():
    assert parse_tool_calls(json.dumps(CALL), []) == (json.dumps(CALL), [], [])


def test_served_factory_builds_nothing_until_the_first_turn(monkeypatch):
    from elm_memory.graphs import serving

    monkeypatch.setattr(serving, "served_elm", lambda: (_ for _ in ()).throw(AssertionError("built early")))
    monkeypatch.setenv("ELM_AGENT_MODEL", "elm_memory.graphs.serving:served_chat_model")
    model = serving.chat_model_from_env()
    assert isinstance(model, ElmChatModel)
    with pytest.raises(AssertionError, match="built early"):
        model.generation_backend()


class ScriptedBackend:
    """The tiny model's tokenizer and info, with replies written by ``reply(turn)`` instead of the model;
    records each prompt as text."""

    def __init__(self, real, reply):
        self.tokenizer, self.info, self.reply, self.prompts = real.tokenizer, real.info, reply, []

    def generate(self, prompts, params):
        self.prompts.append(self.tokenizer.decode(list(prompts[0].token_ids)))
        text = self.reply(len(self.prompts))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [[Generation(text=text, token_ids=ids, finish_reason="stop")]]


@pytest.mark.model
def test_chat_model_generates_with_the_backend_and_renders_tools(tiny_backend):
    model = ElmChatModel(backend=tiny_backend, max_new_tokens=8)
    reply = model.bind_tools([solve_math]).invoke([HumanMessage("What is 2+3?")])
    assert isinstance(reply, AIMessage) and reply.usage_metadata["output_tokens"] <= 8
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    # SmolLM2's template knows no tools: they and the calls are written into the messages
    history = [
        SystemMessage("Be brief."),
        HumanMessage("What is 2+3?"),
        AIMessage("", tool_calls=[{"name": "solve_math", "args": {"question": "2+3"}, "id": "c1"}]),
        ToolMessage('{"answer": "5"}', tool_call_id="c1", name="solve_math"),
    ]
    text = render_chat(tiny_backend.tokenizer, history, [{"type": "function", "function": {"name": "solve_math"}}])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "solve_math"' in text
    assert '<tool_call>\n{"name": "solve_math", "arguments": {"question": "2+3"}}\n</tool_call>' in text
    assert '<tool_response>\n{"answer": "5"}\n</tool_response>' in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_default_models_template_gets_the_tools_natively():
    from transformers import AutoTokenizer

    from elm_memory.models.prepare import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_model("packaged:qwen2.5-coder-0.5b", verbose=False)))
    history = [
        HumanMessage("What is 2+3?"),
        AIMessage("", tool_calls=[{"name": "solve_math", "args": {"question": "2+3"}, "id": "c1"}]),
        ToolMessage('{"answer": "5"}', tool_call_id="c1", name="solve_math"),
    ]
    text = render_chat(tokenizer, history, [{"type": "function", "function": {"name": "solve_math"}}])
    assert "<tools>" in text and '{"name": "solve_math", "arguments": {"question": "2+3"}}' in text
    assert '<tool_response>\n{"answer": "5"}\n</tool_response>' in text


@pytest.mark.model
def test_agent_turns_are_bounded_and_repeats_stopped(tiny_backend):
    from elm_memory.integrations.agents import build_math_agent

    def call(question):
        return f"<tool_call>{json.dumps({'name': 'solve_math', 'arguments': {'question': question}})}</tool_call>"

    looping = ScriptedBackend(tiny_backend, lambda turn: call(f"step {turn}"))  # a new call every turn
    out = build_math_agent(ElmChatModel(backend=looping), [solve_math], max_steps=3).invoke(
        {"messages": [HumanMessage("What is 2+3?")]}
    )
    assert len(looping.prompts) == 3
    assert out["messages"][-1].content == "Stopped after 3 tool calls without a final answer."
    assert sum(isinstance(m, ToolMessage) for m in out["messages"]) == 3

    repeating = ScriptedBackend(tiny_backend, lambda turn: call("What is 2+3?"))
    out = build_math_agent(ElmChatModel(backend=repeating), [solve_math]).invoke({"messages": [HumanMessage("2+3?")]})
    assert len(repeating.prompts) == 2 and sum(isinstance(m, ToolMessage) for m in out["messages"]) == 1
    assert out["messages"][-1].content.startswith("Stopped: the model repeated a tool call this run already answered")
    assert '{"answer": "5"}' in out["messages"][-1].content

    # a forced first call starts the reply for the model; a plain answer then ends the run
    forced = ScriptedBackend(tiny_backend, lambda turn: '"question": "2+3"}}' if turn == 1 else "It is 5.")
    out = build_math_agent(ElmChatModel(backend=forced), [solve_math], first_tool_choice="required").invoke(
        {"messages": [HumanMessage("2+3?")]}
    )
    assert forced.prompts[0].endswith('<tool_call>\n{"name": "solve_math", "arguments": {')
    assert out["messages"][1].tool_calls[0]["args"] == {"question": "2+3"}
    assert out["messages"][-1].content == "It is 5." and len(forced.prompts) == 2


@pytest.mark.model
def test_elm_agent_prints_the_conversation_on_the_tiny_model():
    """End to end on SmolLM2 (plumbing: it may or may not call the tool); the run ends within its turns."""
    r = subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", "agent", "What is 2+3?", "--preset", "cpu-tiny"]
        + ["--max-turns", "2", "--max-tokens", "24", "--no-learn"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "user: What is 2+3?" and any(line.startswith("assistant: ") for line in lines)
    assert any(line.startswith("tool's answer: ") for line in lines)
    turns = int(next(line for line in lines if line.startswith("model turns: ")).split()[2])
    assert 1 <= turns <= 2
