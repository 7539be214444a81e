"""Run a ReAct-style agent that uses ELM as its math tool, on the CPU.

    .venv/bin/python examples/math_agent.py            # default model (cpu-demo preset)
    .venv/bin/python examples/math_agent.py --tiny     # SmolLM2 plumbing run in seconds

Each question is answered through ELM (retrieve, dual-generate, route) and learned from;
the second question can then retrieve the memory of the first.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.messages import HumanMessage  # noqa: E402

from elm_memory import ELM, ELMConfig  # noqa: E402
from integrations.agents import build_math_agent  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 with the cpu-tiny preset")
    parser.add_argument("--store", help="store.path (relative: under $ELM_HOME); default: the preset's store")
    args = parser.parse_args()
    overrides = {"store": {"path": args.store}} if args.store else None
    cfg = ELMConfig.load(preset="cpu-tiny" if args.tiny else "cpu-demo", overrides=overrides)
    with ELM(cfg) as elm:
        agent = build_math_agent(lambda: elm)
        for question in [
            "Tom has 3 apples and buys 4 more. How many apples does he have?",
            "Sara has 5 pears and buys 2 more. How many pears does she have?",
        ]:
            out = agent.invoke({"messages": [HumanMessage(question)]})
            for message in out["messages"]:
                print(f"{type(message).__name__:>12}: {message.content or message.tool_calls}")
            print()


if __name__ == "__main__":
    main()
