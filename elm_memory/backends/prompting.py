"""Question -> model input: validation, the paper's prompt, the chat template, the token
position where a memory (soft prompt) is inserted, and the answer prompt every answer path
generates from (:class:`AnswerPrompt`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elm_memory.backends.base import PromptInput
from elm_memory.config import PromptConfig
from elm_memory.errors import InvalidQuestionError
from elm_memory.memory.ids import validate_question

if TYPE_CHECKING:
    import torch

    from elm_memory.memory import LatentMemory


@dataclass(frozen=True)
class BuiltPrompt:
    """A templated prompt as token ids, with the insertion points a memory may use."""

    text: str
    token_ids: tuple[int, ...]
    user_turn_at: int  # index of the first token of the user message

    def memory_position(self, position: str) -> int:
        return 0 if position == "prefix" else self.user_turn_at


@dataclass(frozen=True)
class AnswerPrompt:
    """What an answer to a question is generated from: zero-shot, or with a memory's soft prompt.

    Built only by :meth:`PromptBuilder.answer_prompt`, for the graph's answers, the evaluation
    baselines and the offline protocol alike: the greedy cache keys on the exact prompt, so one
    builder is what makes a method's zero-shot answer the very one another method got.
    """

    built: BuiltPrompt
    memory_at: int  # the token a memory's soft prompt is inserted before

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.built.token_ids

    def zero_shot(self) -> PromptInput:
        return PromptInput(self.built.token_ids)

    def with_memory(self, soft_prompt: torch.Tensor) -> PromptInput:
        return PromptInput(self.built.token_ids, soft_prompt=soft_prompt, soft_prompt_at=self.memory_at)

    def for_memory(self, memory: LatentMemory) -> PromptInput:
        """The prompt conditioned on a stored memory of any kind: its soft prompt at ``memory_at``, or its
        lora/prefix adapter applied to the model (the prompt's tokens unchanged)."""
        if memory.kind == "soft_prompt":
            return self.with_memory(memory.soft_prompt)
        return PromptInput(self.built.token_ids, memory=memory.adapter())


class PromptBuilder:
    """Builds the paper's prompt for a tokenizer, wrapped in its chat template when it has one."""

    def __init__(self, tokenizer: Any, cfg: PromptConfig | None = None, max_context: int | None = None):
        self.tokenizer = tokenizer
        self.cfg = cfg or PromptConfig()
        self.max_context = max_context
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat = has_template if self.cfg.use_chat_template is None else self.cfg.use_chat_template
        if self.use_chat and not has_template:
            raise InvalidQuestionError("prompt.use_chat_template is true but the tokenizer has no chat template")

    def user_message(self, question: str) -> str:
        return self.cfg.template.replace("{question}", question)

    def build(self, question: Any, *, reserve: int = 0) -> BuiltPrompt:
        """Template ``question``; ``reserve`` tokens (memory + minimum answer) must still fit the context."""
        question = validate_question(question)
        content = self.user_message(question)
        if self.use_chat:
            messages = []
            if self.cfg.system_prompt is not None:
                messages.append({"role": "system", "content": self.cfg.system_prompt})
            messages.append({"role": "user", "content": content})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            cut = text.rindex(content)
            head = self.tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
            tail = self.tokenizer(text[cut:], add_special_tokens=False)["input_ids"]
        else:
            text = content
            enc = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            bos = self.tokenizer.bos_token_id
            n_head = 1 if enc and bos is not None and enc[0] == bos else 0
            head, tail = enc[:n_head], enc[n_head:]
        ids = tuple(head) + tuple(tail)
        if self.max_context is not None and len(ids) + reserve > self.max_context:
            raise InvalidQuestionError(
                f"question too long: {len(ids)} prompt tokens + {reserve} reserved exceed the model context "
                f"of {self.max_context} tokens"
            )
        return BuiltPrompt(text=text, token_ids=ids, user_turn_at=len(head))

    def answer_prompt(self, question: Any, *, memory_tokens: int) -> AnswerPrompt:
        """The prompt to answer ``question`` from, with room for a memory of ``memory_tokens`` and
        at least one answer token (so a question is refused alike with or without a memory)."""
        built = self.build(question, reserve=memory_tokens + 1)
        return AnswerPrompt(built, built.memory_position(self.cfg.soft_prompt_position))
