from __future__ import annotations

import pytest

from elm_memory.config import PromptConfig
from elm_memory.errors import InvalidQuestionError
from elm_memory.models.prompting import PromptBuilder, validate_question


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "empty"),
        ("   \n\t", "empty"),
        (b"\xff\xfe caf\xe9", "not valid UTF-8"),
        ("caf\udce9", "not valid UTF-8"),  # how argv delivers undecodable bytes
        (42, "must be text"),
        (None, "must be text"),
        ("a\x00b", "NUL"),
    ],
)
def test_bad_questions_are_typed_errors(bad, message):
    with pytest.raises(InvalidQuestionError, match=message):
        validate_question(bad)


def test_valid_questions_are_stripped_and_bytes_decoded():
    assert validate_question("  What is 2+2? \n") == "What is 2+2?"
    assert validate_question("café".encode()) == "café"


def test_chat_template_wraps_the_papers_prompt(tiny_loaded):
    tok = tiny_loaded.tokenizer
    built = PromptBuilder(tok, PromptConfig()).build("What is 2+3?")
    assert "<|im_start|>user\nPlease reason step by step, and put your final answer within \\boxed{}.\nWhat is 2+3?" in built.text
    assert built.text.endswith("<|im_start|>assistant\n")
    # Tokenising in two pieces (header | user turn) gives the same ids as the whole text.
    assert list(built.token_ids) == tok(built.text, add_special_tokens=False)["input_ids"]
    head = tok.decode(built.token_ids[: built.user_turn_at])
    assert head.endswith("<|im_start|>user\n")
    assert tok.decode(built.token_ids[built.user_turn_at :]).startswith("Please reason step by step")
    assert built.memory_position("prefix") == 0 and built.memory_position("user_turn") == built.user_turn_at


def test_plain_prompt_without_chat_template(tiny_loaded):
    built = PromptBuilder(tiny_loaded.tokenizer, PromptConfig(use_chat_template=False)).build("What is 2+3?")
    assert built.text == "Please reason step by step, and put your final answer within \\boxed{}.\nWhat is 2+3?"
    assert "<|im_start|>" not in built.text


def test_system_prompt_and_custom_template(tiny_loaded):
    cfg = PromptConfig(system_prompt="You are terse.", template="Q: {question}\nA:")
    built = PromptBuilder(tiny_loaded.tokenizer, cfg).build("1+1?")
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in built.text and "Q: 1+1?\nA:" in built.text


def test_over_long_question_is_refused(tiny_loaded):
    builder = PromptBuilder(tiny_loaded.tokenizer, PromptConfig(), max_context=64)
    builder.build("short")
    with pytest.raises(InvalidQuestionError, match="too long"):
        builder.build("word " * 100)
    with pytest.raises(InvalidQuestionError, match="too long"):
        builder.build("short", reserve=60)  # the memory must fit too
