"""Teacher forcing's log-probs and their gradient into a soft prompt equal a plain reference (every
position through the lm_head, sliced, one log-softmax), and its backward never zero-fills a copy of all
the logits: indexing a row or slicing positions of the logits would (``aten::fill_`` over B x T x vocab
per row), which was most of a training step's backward on a CPU."""

from __future__ import annotations

import pytest
import torch
from _fakes import tiny_qwen2_config

from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs

VOCAB = 300
COMPLETIONS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
PROMPT = (20, 21, 22, 23, 24, 25)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, 256)).eval().requires_grad_(False)


def _soft(model) -> torch.Tensor:
    torch.manual_seed(1)
    return (0.1 * torch.randn(4, model.config.hidden_size)).requires_grad_(True)


def _reference(model, soft: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each completion alone, every position's logits, log-softmax, the completion tokens' entries."""
    emb = model.get_input_embeddings()
    out = []
    for comp in COMPLETIONS:
        x = torch.cat([soft, emb(torch.tensor(PROMPT)), emb(torch.tensor(comp))]).unsqueeze(0)
        logits = model(inputs_embeds=x).logits[0, -len(comp) - 1 : -1].float() / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(comp).unsqueeze(1)).squeeze(1)
        out.append(torch.nn.functional.pad(lp, (0, 5 - len(comp))))
    return torch.stack(out)


@pytest.mark.parametrize("share_prompt_kv", [False, True])
def test_log_probs_and_soft_prompt_gradient_match_a_plain_reference(model, share_prompt_kv):
    soft = _soft(model)
    prompt = PromptInput(PROMPT, soft_prompt=soft, soft_prompt_at=0)
    lp, mask = completion_logprobs(model, [prompt], COMPLETIONS, temperature=0.7, share_prompt_kv=share_prompt_kv)
    (lp * mask).sum().backward()
    ref_soft = _soft(model)
    ref = _reference(model, ref_soft, 0.7)
    (ref * mask).sum().backward()
    torch.testing.assert_close(lp * mask, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(soft.grad, ref_soft.grad, atol=2e-5, rtol=1e-4)
    assert soft.grad.abs().sum() > 0


@pytest.mark.parametrize("share_prompt_kv", [False, True])
def test_the_backward_never_zero_fills_all_the_logits(model, share_prompt_kv):
    from torch.profiler import ProfilerActivity, profile

    soft = _soft(model)
    prompt = PromptInput(PROMPT, soft_prompt=soft, soft_prompt_at=0)
    lp, mask = completion_logprobs(model, [prompt], COMPLETIONS, temperature=0.7, share_prompt_kv=share_prompt_kv)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (lp * mask).sum().backward()
    logits_numel = len(COMPLETIONS) * 5 * VOCAB
    fills = [
        e.input_shapes
        for e in prof.events()
        if e.name in ("aten::fill_", "aten::zero_", "aten::zeros")
        and e.input_shapes
        and e.input_shapes[0]
        and torch.Size(e.input_shapes[0]).numel() >= logits_numel
    ]
    assert not fills, fills


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_from_pieces_equal_the_plain_expression_and_its_gradient_bit_for_bit(temperature):
    """The written-out log-probs (logits in pieces along T, an empty piece too) give autograd's values and
    gradients for ``(row.float() / t).gather(targets) - logsumexp(row.float() / t)`` exactly, so training
    is unchanged by it."""
    from elm_memory.backends.teacher_forcing import _TokenLogprobs

    g = torch.Generator().manual_seed(3)
    rows, length, vocab = 3, 7, 1000
    logits = (3 * torch.randn(rows, length, vocab, generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows, length), generator=g)
    upstream = torch.randn(rows, length, generator=g)
    upstream[1, 4:] = 0.0  # masked positions: no gradient from them

    plain_in = logits.clone().requires_grad_(True)
    out = []
    for i, r in enumerate(plain_in.unbind(0)):  # what completion_logprobs computed before, row by row
        row = r.float() / temperature
        out.append(row.gather(1, targets[i].unsqueeze(1)).squeeze(1) - torch.logsumexp(row, dim=-1))
    plain = torch.stack(out)
    plain.backward(upstream)

    pieces = [logits[:, :1].clone(), logits[:, 1:1].clone(), logits[:, 1:].clone()]
    for p in pieces:
        p.requires_grad_(True)
    mine = _TokenLogprobs.apply(temperature, targets, *pieces)
    mine.backward(upstream)

    assert torch.equal(mine, plain)
    assert torch.equal(torch.cat([p.grad for p in pieces], dim=1), plain_in.grad)
    with torch.no_grad():  # as the reference policy's pass: the values alone
        assert torch.equal(_TokenLogprobs.apply(temperature, targets, logits), plain.detach())
