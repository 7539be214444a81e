"""A LangChain chat model over ELM's own generation backend: the packaged model as the agent's
chat model, offline, with tool calling.

    model = ElmChatModel.from_elm(elm)          # the model ELM answers with; loaded on the first turn
    agent = build_math_agent(model, [create_elm_tool(elm)])

Each turn renders the conversation with the tokenizer's chat template (the bound tools passed to
it as ``tools``), decodes greedily with the backend's ``generate`` (at most ``max_new_tokens``), and
reads tool calls from what the model wrote: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the Qwen2.5 / hermes format its template asks for), or the same object as plain JSON, which small
models often write instead. Text that holds no well-formed call to a bound tool is a plain answer.
A template without tool support (SmolLM2's) gets the tools and the calls written into the
messages in that same format. ``tool_choice`` ``"required"``/``"any"``/a tool's name starts the
reply with the call's opening (``<tool_call>`` and, for one tool, its name), so the model writes
the arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from elm_memory.backends.base import PromptInput, SamplingParams, answer_budget
from elm_memory.errors import ConfigError, InvalidQuestionError

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_MARKER = re.compile(r"<\|[^|<>]{1,40}\|>")  # <|im_end|> and the like, kept by a decode that skips nothing

# Qwen2.5's own tool instructions (its chat template's), for templates that know no tools
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """What a model's reply says: ``(content, tool_calls, invalid_tool_calls)`` in LangChain's shapes.

    Calls are read from ``<tool_call>...</tool_call>`` spans (an unclosed last one too, for a reply cut
    by the token budget), else from plain JSON objects ``{"name": ..., "arguments": {...}}`` in the
    text (a ```json fence allowed). A call must name one of ``tool_names`` and carry an object of
    arguments (``"parameters"`` is read as ``"arguments"``; a JSON string of them too). A tagged span
    that is not such a call is an invalid call, and when no valid call remains the reply is a plain
    answer whose content is the whole text."""
    names = set(tool_names)
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    spans = list(_TAGGED.finditer(text))
    if spans:
        for span in spans:
            body = span.group(1).strip()
            call, error = _call_of(_unfenced(body), names)
            if call is not None:
                calls.append(call)
            else:
                invalid.append({"type": "invalid_tool_call", "name": None, "args": body, "id": None, "error": error})
        content = _TAGGED.sub("", text) if calls else text
    elif names:
        content, calls = _plain_json_calls(text, names)
    else:
        content = text
    return _MARKER.sub("", content).strip(), calls, invalid


def _unfenced(body: str) -> str:
    fenced = _FENCE.match(body.strip())
    return fenced.group(1).strip() if fenced else body


def _call_of(body: str | Any, names: set[str]) -> tuple[dict[str, Any] | None, str]:
    """One call from a JSON text (or an already parsed object), or None and why not."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError as exc:
            completed = _completed(body)
            if completed is None:
                return None, f"not JSON: {exc}"
            body = completed[0]
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None, 'not an object with a "name"'
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None, "arguments are not a JSON object"
    if not isinstance(args, dict):
        return None, "arguments are not a JSON object"
    if names and body["name"] not in names:
        return None, f"no tool named {body['name']!r} (tools: {', '.join(sorted(names))})"
    return {"type": "tool_call", "name": body["name"], "args": args, "id": f"call_{uuid.uuid4().hex[:12]}"}, ""


def _plain_json_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """Calls written as plain JSON objects (or a list of them), with the text around them as content."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    i = last = 0
    while (start := _next_json(text, i)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            completed = _completed(text[start:])
            if completed is None:
                i = start + 1
                continue
            value, end = completed[0], len(text)
        found = [c for c in (_call_of(v, names)[0] for v in (value if isinstance(value, list) else [value])) if c]
        if found and len(found) == (len(value) if isinstance(value, list) else 1):
            calls += found
            kept.append(text[last:start])
            last = end
        i = end
    if not calls:
        return text, []
    kept.append(text[last:])
    return re.sub(r"```[A-Za-z]*\s*```", "", "".join(kept)), calls  # drop the fences the JSON sat in


def _completed(text: str) -> tuple[Any] | None:
    """``(value,)`` of JSON that the reply's end cut short of its closing brackets (the 0.5B model often
    leaves off the last ``}``), else None: the brackets still open at the end are closed; nothing else is
    repaired (an unclosed string, a bare word, a missing comma stay malformed)."""
    open_: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            open_.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not open_ or open_.pop() != ch:
                return None
            if not open_:
                return None  # complete before the end: not cut short
    if in_string or not open_:
        return None
    try:
        return (json.loads(text + "".join(reversed(open_))),)
    except ValueError:
        return None


def _next_json(text: str, start: int) -> int:
    found = [p for p in (text.find("{", start), text.find("[", start)) if p >= 0]
    return min(found) if found else -1


class ElmChatModel(BaseChatModel):
    """A chat model whose replies come from an ELM generation backend (greedy, ``max_new_tokens`` per turn).

    ``backend``: a :class:`~elm_memory.backends.base.GenerationBackend` with a ``tokenizer`` that has a
    chat template, or a zero-argument callable returning one (called on the first turn);
    :meth:`from_elm` shares the ELM's own backend, so one model serves the agent and the tool."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    backend: Any = Field(exclude=True)
    max_new_tokens: int = Field(default=256, ge=1)
    _resolved: list[Any] = PrivateAttr(default_factory=list)

    @classmethod
    def from_elm(cls, elm: Any, **kwargs: Any) -> ElmChatModel:
        """Over ``elm``'s backend (loaded on the first turn, if not yet)."""
        return cls(backend=lambda: elm.backend, **kwargs)

    @property
    def _llm_type(self) -> str:
        return "elm-memory"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens}

    def generation_backend(self) -> Any:
        if not self._resolved:
            backend = self.backend
            if not hasattr(backend, "generate") and callable(backend):
                backend = backend()
            if not hasattr(backend, "generate") or not hasattr(backend, "tokenizer"):
                raise ConfigError(f"ElmChatModel needs a generation backend, not {type(backend).__name__}")
            self._resolved.append(backend)
        return self._resolved[0]

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """The model with ``tools`` (LangChain tools, functions, pydantic classes or OpenAI tool dicts)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        backend = self.generation_backend()
        tokenizer = backend.tokenizer
        tools = [] if tool_choice == "none" else list(tools or [])
        names = [t["function"]["name"] for t in tools]
        start = _reply_start(tool_choice, names)
        text = render_chat(tokenizer, messages, tools) + start
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        max_context = backend.info.max_context
        if len(ids) >= max_context:
            raise InvalidQuestionError(
                f"the conversation is {len(ids)} tokens; the model's context is {max_context} tokens"
            )
        params = SamplingParams(max_new_tokens=answer_budget(self.max_new_tokens, max_context, len(ids)))
        generation = backend.generate([PromptInput(ids)], params)[0][0]
        reply = start + tokenizer.decode(generation.token_ids, skip_special_tokens=False)
        for s in stop or ():
            reply = reply.split(s, 1)[0]
        content, calls, invalid = parse_tool_calls(reply, names)
        message = AIMessage(
            content=content,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            response_metadata={"finish_reason": generation.finish_reason, "model_name": backend.info.name},
            usage_metadata={
                "input_tokens": len(ids),
                "output_tokens": len(generation.token_ids),
                "total_tokens": len(ids) + len(generation.token_ids),
            },
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={"raw": reply})])


def _reply_start(tool_choice: Any, names: list[str]) -> str:
    """The text a reply starts with so that it is a call: the call's opening, with the tool's name when
    only one tool can be meant; "" when the model may answer freely."""
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    if tool_choice is True or tool_choice in ("required", "any"):
        tool_choice = names[0] if len(names) == 1 else "any"
    if not names or not isinstance(tool_choice, str) or tool_choice in ("auto", "none"):
        return ""
    if tool_choice == "any":
        return '<tool_call>\n{"name": "'
    if tool_choice not in names:
        raise ConfigError(f"tool_choice {tool_choice!r} names no bound tool (tools: {', '.join(names)})")
    return f'<tool_call>\n{{"name": "{tool_choice}", "arguments": {{'


def render_chat(tokenizer: Any, messages: Sequence[BaseMessage], tools: Sequence[dict[str, Any]]) -> str:
    """The conversation as the model's prompt text, ending with the assistant's turn opened."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("the model's tokenizer has no chat template: ElmChatModel needs an instruct model")
    native = "tool_calls" in template and "tools" in template
    turns = [_template_message(m, native) for m in messages]
    if tools and not native:  # the template ignores tools: write them into the system message
        block = _TOOLS_HEADER + "\n".join(json.dumps(t) for t in tools) + _TOOLS_FOOTER
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{block}"}
        else:
            turns.insert(0, {"role": "system", "content": block})
    extra = {"tools": list(tools)} if tools and native else {}
    return str(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra))


def _template_message(message: BaseMessage, native: bool) -> dict[str, Any]:
    text = message.text
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, ToolMessage):
        if native:
            return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id, "name": message.name}
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if isinstance(message, AIMessage):
        calls = [{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
        if not native:
            written = "".join(f"\n<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
            return {"role": "assistant", "content": (text + written).strip()}
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            out["tool_calls"] = [
                {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        return out
    return {"role": message.type, "content": text}
