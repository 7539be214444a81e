from __future__ import annotations

import pytest
import torch

from elm_memory.backends.base import Generation, PromptInput, to_prompt_input
from elm_memory.backends.prompting import PromptBuilder, validate_question
from elm_memory.config import PromptConfig
from elm_memory.errors import InvalidQuestionError


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
    paper = "Please reason step by step, and put your final answer within \\boxed{}."
    assert f"<|im_start|>user\n{paper}\nWhat is 2+3?" in built.text
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


# -- one answer prompt for every answer path ----------------------------------------------------------


class RecordingBackend:
    """The tiny backend with a canned answer (no decoding): keeps every prompt it is asked to complete."""

    def __init__(self, backend):
        self._backend = backend
        self.seen: list[PromptInput] = []

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def generate(self, prompts, params):
        inputs = [to_prompt_input(p, self._backend.tokenizer) for p in prompts]
        self.seen.extend(inputs)
        return [[Generation("\\boxed{7}", [1], "stop") for _ in range(params.n)] for _ in inputs]

    def take(self) -> list[PromptInput]:
        seen, self.seen = self.seen, []
        return seen


def _same_prompt(a: PromptInput, b: PromptInput) -> bool:
    if a.token_ids != b.token_ids or a.soft_prompt_at != b.soft_prompt_at:
        return False
    if a.soft_prompt is None or b.soft_prompt is None:
        return a.soft_prompt is None and b.soft_prompt is None
    return torch.equal(a.soft_prompt, b.soft_prompt)


@pytest.mark.model
def test_graph_baselines_and_offline_protocol_answer_from_the_same_prompt(tiny_loaded, tiny_backend, tmp_path):
    """The greedy cache keys on the exact prompt: ELM's zero-shot candidate, the zero_shot baseline and the
    offline protocol must send the same one (and ELM and offline the same memory prompt)."""
    from elm_memory.config import ELMConfig
    from elm_memory.data.datasets import Problem
    from elm_memory.elm import ELM
    from elm_memory.eval.methods.base import EvalRuntime, build_method
    from elm_memory.eval.offline import run_offline

    question = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "model": {"dtype": "float32"},
            "store": {"path": str(tmp_path / "store")},
            "training": {"steps": 0},  # memory = its initialisation: the same in the graph and offline
            "prompt": {"soft_prompt_position": "user_turn"},  # a memory position other than 0, so it is checked
            "retrieval": {"skip_no_consensus": False},
        },
    )
    rec = RecordingBackend(tiny_backend)

    elm = ELM(cfg, loaded=tiny_loaded, backend=rec)
    try:
        elm.learn(question, progress=False)
        rec.take()
        elm.answer(question, learn=False)
        graph = rec.take()
    finally:
        elm.close()
    assert len(graph) == 2 and graph[1].soft_prompt is not None  # zero-shot and memory candidates

    runtime = EvalRuntime(cfg, tmp_path / "online", loaded=tiny_loaded, backend=rec)
    try:
        build_method("zero_shot", runtime).answer(question, 0)
    finally:
        runtime.close()
    [baseline] = rec.take()

    out = tmp_path / "offline"
    runtime = EvalRuntime(cfg, out, loaded=tiny_loaded, backend=rec)
    run_offline([Problem("q1", question, "7")], cfg, out, train=1, runtime=runtime, progress=False, plots=False)
    offline = rec.take()
    offline_zero = [p for p in offline if p.soft_prompt is None]
    offline_memory = [p for p in offline if p.soft_prompt is not None]
    assert len(offline_zero) == 1 and len(offline_memory) == 1

    assert graph[0].soft_prompt is None and graph[1].soft_prompt_at > 0
    assert _same_prompt(graph[0], baseline) and _same_prompt(graph[0], offline_zero[0])
    assert _same_prompt(graph[1], offline_memory[0])


def test_answer_prompt_reserves_the_memory_and_places_it(tiny_loaded):
    builder = PromptBuilder(tiny_loaded.tokenizer, PromptConfig(soft_prompt_position="user_turn"), max_context=64)
    prompt = builder.answer_prompt("short", memory_tokens=8)
    built = builder.build("short")
    assert prompt.zero_shot() == PromptInput(built.token_ids) and prompt.memory_at == built.user_turn_at > 0
    soft = torch.zeros(8, tiny_loaded.info.hidden_size)
    assert prompt.with_memory(soft).soft_prompt_at == built.user_turn_at
    with pytest.raises(InvalidQuestionError, match="too long"):
        builder.answer_prompt("short", memory_tokens=64 - len(built.token_ids))  # no room left for an answer
