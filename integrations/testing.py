"""A scripted tool-calling chat model: a test double for agents when no chat model can run.

It asks the first bound tool to solve the user's last message, then reports the tool's
``answer``. Deterministic and model-free, so tests and the served-graph check exercise the
whole agent loop (tool call, tool message, final message) on any machine. Real agents use a
real chat model (see ``elm_memory.integrations.agents``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult


class ScriptedToolCaller(BaseChatModel):
    tool_names: list[str] = []

    @property
    def _llm_type(self) -> str:
        return "scripted-tool-caller"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedToolCaller:
        names = [getattr(t, "name", None) or t["name"] for t in tools]
        return self.model_copy(update={"tool_names": names})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            answer = json.loads(str(last.content)).get("answer")
            message = AIMessage(content=f"The answer is {answer}.")
        elif isinstance(last, HumanMessage) and self.tool_names:
            call = {
                "name": self.tool_names[0],
                "args": {"question": str(last.content)},
                "id": f"call_{uuid.uuid4().hex[:8]}",
            }
            message = AIMessage(content="", tool_calls=[call])
        else:
            message = AIMessage(content="I can only solve math questions.")
        return ChatResult(generations=[ChatGeneration(message=message)])


def scripted_tool_caller() -> ScriptedToolCaller:
    """Factory for ``ELM_AGENT_MODEL=elm_memory.integrations.testing:scripted_tool_caller``."""
    return ScriptedToolCaller()
