"""A tool-calling agent whose math tool is ELM, with a real chat model.

With no flags the chat model is the packaged model ELM answers with, run in this process (offline,
``elm_memory.integrations.chat_model``). Or an OpenAI-compatible server with tool calling, e.g. vLLM
serving the packaged model (see docs/vllm.md):

    .venv/bin/python examples/math_agent.py                     # the packaged model, in process
    .venv/bin/python examples/math_agent.py --base-url http://127.0.0.1:8000/v1 --model MODEL
    .venv/bin/python examples/math_agent.py --scripted --tiny   # no chat model: the scripted test double

Each question goes to the agent; the model decides to call ``solve_math`` (ELM: retrieve,
dual-generate, route, then learn), and the second question can retrieve the first one's memory.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.messages import HumanMessage  # noqa: E402

from elm_memory import ELM, ELMConfig  # noqa: E402
from elm_memory.integrations.agents import build_math_agent, conversation, format_turn  # noqa: E402
from elm_memory.integrations.tools import create_elm_tool  # noqa: E402


def chat_model(args: argparse.Namespace, elm: ELM):
    if args.scripted:
        from elm_memory.integrations.testing import ScriptedToolCaller

        return ScriptedToolCaller()
    if not args.base_url and not args.model:
        from elm_memory.integrations.chat_model import ElmChatModel

        return ElmChatModel.from_elm(elm, max_new_tokens=256)  # ELM's own model, greedy
    if not args.base_url or not args.model:
        raise SystemExit("give both --base-url and --model of an OpenAI-compatible server with tool calling")
    from langchain_openai import ChatOpenAI

    # max_tokens: a small model can loop on a tool call as text; bound each turn
    return ChatOpenAI(
        model=args.model,
        base_url=args.base_url,
        api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        temperature=0,
        max_tokens=256,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint of the chat model (…/v1)")
    parser.add_argument("--model", help="model name on that server")
    parser.add_argument("--scripted", action="store_true", help="use the scripted test double instead of a model")
    parser.add_argument("--first-tool-choice", help="e.g. 'required': force the first turn's tool call (small models)")
    parser.add_argument("--max-turns", type=int, default=4, help="most model turns per question")
    parser.add_argument("--tiny", action="store_true", help="ELM on SmolLM2 with the cpu-tiny preset")
    parser.add_argument("--store", help="store.path (relative: under $ELM_HOME); default: the preset's store")
    args = parser.parse_args()
    overrides = {"store": {"path": args.store}} if args.store else None
    cfg = ELMConfig.load(preset="cpu-tiny" if args.tiny else "cpu-demo", overrides=overrides)
    with ELM(cfg) as elm:
        agent = build_math_agent(
            chat_model(args, elm),
            [create_elm_tool(elm, include_trace=True)],
            max_steps=args.max_turns,
            first_tool_choice=args.first_tool_choice,
        )
        for question in [
            "Tom has 3 apples and buys 4 more. How many apples does he have?",
            "Sara has 5 pears and buys 2 more. How many pears does she have?",
        ]:
            out = agent.invoke({"messages": [HumanMessage(question)]})
            for turn in conversation(out["messages"]):
                print(format_turn(turn))
            print()


if __name__ == "__main__":
    main()
