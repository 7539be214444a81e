"""ELM as a LangChain ``Runnable``::

runnable = ElmRunnable(ELM(ELMConfig.load(preset="cpu-demo")))
runnable.invoke({"question": "What is 17 + 25?"})       # -> dict with answer, route, ...
runnable.invoke("What is 17 + 25?")                       # a bare string works too
tool = runnable.as_tool(name="solve_math", description="Solve a math word problem")

Inside a LangGraph run (as a node, or called by one) it follows the run as the ELM graph does:
the namespace from the run's context (any schema) or the config's ``namespace_template`` filled
from it and the ``configurable`` it is given; ``learn: false`` in the context turns learning off.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig

from elm_memory.errors import InvalidQuestionError
from elm_memory.graph.context import settings_of_enclosing_run


class ElmRunnable(Runnable[Any, dict[str, Any]]):
    """``invoke({"question": ..., "namespace": ..., "learn": ...})`` -> the answer trace as a dict.

    The input's ``namespace`` and ``learn`` win over the run's; ``learn`` (here) is the default."""

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
        cfg = self.elm.config
        namespace, run_learn = settings_of_enclosing_run(
            config, namespace=input.get("namespace"), template=cfg.namespace_template, default=cfg.namespace
        )
        learn = input.get("learn")
        if learn is None:
            learn = self.learn and run_learn is not False
        return self.elm.answer(input["question"], namespace=namespace, learn=bool(learn)).to_dict()
