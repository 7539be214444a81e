"""ELM as a LangChain ``Runnable``::

runnable = ElmRunnable(ELM(ELMConfig.load(preset="cpu-demo")))
runnable.invoke({"question": "What is 17 + 25?"})       # -> dict with answer, route, ...
runnable.invoke("What is 17 + 25?")                       # a bare string works too
tool = runnable.as_tool(name="solve_math", description="Solve a math word problem")
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig

from elm_memory.errors import InvalidQuestionError


class ElmRunnable(Runnable[Any, dict[str, Any]]):
    """``invoke({"question": ..., "namespace": ..., "learn": ...})`` -> the answer trace as a dict."""

    def __init__(self, elm: Any, *, learn: bool = True):
        self.elm = elm
        self.learn = learn

    @property
    def InputType(self) -> Any:  # noqa: N802 (LangChain's name)
        return dict

    @property
    def OutputType(self) -> Any:  # noqa: N802
        return dict

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> dict[str, Any]:
        if isinstance(input, str):
            input = {"question": input}
        if not isinstance(input, dict) or "question" not in input:
            raise InvalidQuestionError("ElmRunnable expects a question string or {'question': ...}")
        result = self.elm.answer(
            input["question"], namespace=input.get("namespace"), learn=input.get("learn", self.learn)
        )
        return result.to_dict()
