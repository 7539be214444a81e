"""The transformers backend on real packaged weights (SmolLM2 fp32 for exactness)."""

from __future__ import annotations

import math

import pytest
import torch

from elm_memory.backends.base import GenerationBackend, PromptInput, SamplingParams
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.errors import IncompatibleMemoryError

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def prompts(tiny_loaded):
    pb = PromptBuilder(tiny_loaded.tokenizer)
    return pb.build("What is 2+3?"), pb.build("Tom has 3 apples and buys 4 more. How many apples does he have?")


def test_backend_satisfies_the_protocol(tiny_backend):
    assert isinstance(tiny_backend, GenerationBackend)


def test_greedy_is_deterministic_and_batching_does_not_change_it(tiny_backend, prompts):
    a, b = (PromptInput(p.token_ids) for p in prompts)
    [[one]] = tiny_backend.generate([a], GREEDY)
    [[again]] = tiny_backend.generate([a], GREEDY)
    [[b_alone]] = tiny_backend.generate([b], GREEDY)
    both = tiny_backend.generate([a, b], GREEDY)  # different lengths: exercises left padding
    assert one.token_ids == again.token_ids and len(one.token_ids) > 0
    assert both[0][0].token_ids == one.token_ids
    assert both[1][0].token_ids == b_alone.token_ids
    assert one.text == tiny_backend.tokenizer.decode(one.token_ids, skip_special_tokens=True)


def test_text_and_token_prompts_agree(tiny_backend, prompts):
    p = prompts[0]
    [[from_ids]] = tiny_backend.generate([list(p.token_ids)], GREEDY)
    [[from_text]] = tiny_backend.generate([p.text], GREEDY)
    assert from_ids.token_ids == from_text.token_ids


def test_zero_length_soft_prompt_equals_plain_generation(tiny_backend, tiny_loaded, prompts):
    p = prompts[0]
    empty = torch.zeros(0, tiny_loaded.info.hidden_size)
    [[plain]] = tiny_backend.generate([PromptInput(p.token_ids)], GREEDY)  # input_ids path
    [[embeds]] = tiny_backend.generate([PromptInput(p.token_ids, soft_prompt=empty)], GREEDY)  # inputs_embeds path
    assert embeds.token_ids == plain.token_ids


@pytest.mark.parametrize("position", ["prefix", "user_turn"])
def test_soft_prompt_of_token_embeddings_equals_inserting_those_tokens(tiny_backend, tiny_loaded, prompts, position):
    """A soft prompt equal to the embeddings of real tokens must act exactly like those tokens."""
    p = prompts[0]
    at = p.memory_position(position)
    inserted = tiny_loaded.tokenizer("Remember: be careful.\n", add_special_tokens=False)["input_ids"]
    soft = tiny_backend.embed_tokens(torch.tensor(inserted)).detach()
    with_tokens = p.token_ids[:at] + tuple(inserted) + p.token_ids[at:]
    [[expected]] = tiny_backend.generate([PromptInput(with_tokens)], GREEDY)
    got = tiny_backend.generate(
        [PromptInput(p.token_ids, soft_prompt=soft, soft_prompt_at=at), PromptInput(prompts[1].token_ids)], GREEDY
    )
    assert got[0][0].token_ids == expected.token_ids
    [[plain]] = tiny_backend.generate([PromptInput(p.token_ids)], GREEDY)
    assert plain.token_ids != expected.token_ids  # the soft prompt really conditions the output


def test_sampling_is_seeded_returns_n_and_logprobs(tiny_backend, prompts):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, n=3, seed=7, logprobs=True)
    [first] = tiny_backend.generate([PromptInput(prompts[0].token_ids)], params)
    [second] = tiny_backend.generate([PromptInput(prompts[0].token_ids)], params)
    assert len(first) == 3
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert len({tuple(g.token_ids) for g in first}) > 1  # really sampled
    for g in first:
        assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 and math.isfinite(lp) for lp in g.logprobs)
        assert g.finish_reason in {"stop", "length"}


def test_logprobs_match_a_teacher_forced_forward(tiny_backend, tiny_loaded, prompts):
    p = PromptInput(prompts[0].token_ids)
    [[g]] = tiny_backend.generate([p], SamplingParams(max_new_tokens=8, logprobs=True))
    ids = torch.tensor([list(p.token_ids) + g.token_ids])
    with torch.no_grad():
        logits = tiny_loaded.model(ids).logits[0, len(p.token_ids) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4)
    # greedy picks the argmax: each chosen token is the most likely one
    assert torch.equal(logits.argmax(-1), torch.tensor(g.token_ids))


def test_length_finish_reason_and_wrong_hidden_size(tiny_backend, prompts):
    [[g]] = tiny_backend.generate([PromptInput(prompts[0].token_ids)], SamplingParams(max_new_tokens=3))
    assert g.finish_reason == "length" and len(g.token_ids) == 3
    with pytest.raises(IncompatibleMemoryError, match="hidden size 896"):
        tiny_backend.generate([PromptInput(prompts[0].token_ids, soft_prompt=torch.zeros(20, 896))], GREEDY)
