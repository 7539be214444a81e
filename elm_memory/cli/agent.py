"""``elm agent``: the packaged math agent (LangGraph v1's ``create_agent``, ELM as its tool) on the
configured model, offline: the model ELM answers with is also the agent's chat model."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from elm_memory.cli.application import app
from elm_memory.cli.errors import handle_errors
from elm_memory.cli.options import ConfigOpt, JsonOpt, NamespaceOpt, PresetOpt, QuestionCommand, SetOpt, load_config


@app.command(cls=QuestionCommand)
@handle_errors
def agent(
    question: Annotated[str, typer.Argument(help="The user's message to the agent.")],
    config: ConfigOpt = None,
    preset: PresetOpt = "cpu-demo",
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    set_: SetOpt = None,
    max_turns: Annotated[
        int, typer.Option("--max-turns", min=1, help="Most model turns per run; then the agent stops, saying so.")
    ] = 4,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Most tokens the model writes per turn.")
    ] = 256,
    first_tool_choice: Annotated[
        str | None,
        typer.Option(
            "--first-tool-choice", help="'required': the first turn must call a tool (the call is begun for it)."
        ),
    ] = None,
    no_learn: Annotated[
        bool, typer.Option("--no-learn", help="The tool answers only; ELM learns no memory from the question.")
    ] = False,
) -> None:
    """Run the math agent on one message; print the conversation and the tool's answer.

    The model (the config's, greedy) decides whether to call solve_math (ELM answers, then learns).

    A run stops after --max-turns model turns, or when the model repeats a call already answered (docs/agents.md)."""
    from elm_memory.backends.prompting import validate_question
    from elm_memory.elm import ELM
    from elm_memory.integrations.agents import build_math_agent, conversation, format_turn
    from elm_memory.integrations.chat_model import ElmChatModel
    from elm_memory.integrations.tools import create_elm_tool

    validate_question(question)
    cfg = load_config(config, preset, namespace, set_)
    started = time.perf_counter()
    with ELM(cfg) as elm:
        math_agent = build_math_agent(
            ElmChatModel.from_elm(elm, max_new_tokens=max_tokens),
            [create_elm_tool(elm, learn=not no_learn, include_trace=True)],
            max_steps=max_turns,
            first_tool_choice=first_tool_choice,
        )
        out = math_agent.invoke({"messages": [("user", question)]})  # the tool answers in cfg.namespace
    seconds = time.perf_counter() - started
    turns = conversation(out["messages"])
    answers = [_tool_answer(t["text"]) for t in turns if t["role"] == "tool"]
    model_turns = sum(1 for m in out["messages"] if m.type == "ai" and m.response_metadata.get("model_name"))
    if json_out:
        summary = {"messages": turns, "tool_answers": answers, "model_turns": model_turns, "seconds": round(seconds, 1)}
        typer.echo(json.dumps(summary, ensure_ascii=False))
        return
    for t in turns:
        typer.echo(format_turn(t))
    shown = ", ".join(str(a) for a in answers) if answers else "none (the model called no tool)"
    typer.echo(f"\ntool's answer: {shown}")
    typer.echo(f"model turns: {model_turns} (at most {max_turns}), {seconds:.1f} s")


def _tool_answer(text: str) -> Any:
    """The ``answer`` of the ELM tool's JSON reply, else the reply as it is (e.g. a tool error)."""
    try:
        reply = json.loads(text)
    except ValueError:
        return text
    return reply.get("answer") if isinstance(reply, dict) else reply
