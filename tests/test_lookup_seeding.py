"""Seeded sampling with lookup drafts, on a tiny random Qwen2 (float32; a peaky head, so drafts get
accepted; prompts of 5, 11 and 8 tokens, so rows are left-padded; a row stops on token 7, so rows of a
batch end at different steps and are dropped).

A prompt's rows are the same alone or beside other prompts, with their own soft prompts, and with
lookup drafts they are the rows plain sampling gives: each row draws its key once from the prompt's
generator, and each token's draw is a hash of (key, token index), so drafts that let rows emit
different numbers of tokens per forward move no draws between rows, and a fresh backend with the same
seed replays a step whatever it generated before.
"""

from __future__ import annotations

import pytest
import torch

from elm_memory.backends.decode import DecodeOptions, sample

VOCAB, HIDDEN, STOP = 40, 32, 7
PROMPTS = [list(range(3, 8)), list(range(3, 14)), list(range(3, 11))]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    m = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    m.lm_head.weight.mul_(8.0)  # peaky: repetitive text, which lookup drafts from
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield m
    torch.set_num_threads(threads)


def _soft_prompts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, HIDDEN, generator=g) for _ in PROMPTS]


def _run(model, batch, lookup: int, earlier=(), n: int = 8, seed: int = 5, max_rows: int = 64):
    """``batch``: (token ids, soft prompt) pairs, the soft prompt as a prefix; left padding as the backend."""
    emb = model.get_input_embeddings()
    rows = [torch.cat([soft, emb(torch.tensor(ids))]) for ids, soft in batch]
    width = max(r.shape[0] for r in rows)
    x = torch.zeros(len(rows), width, HIDDEN)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, width - r.shape[0] :], mask[i, width - r.shape[0] :] = r, 1
    return sample(
        model,
        mask,
        DecodeOptions(60, temperature=1.0, n=n, lookup_draft_tokens=lookup, lookup_max_rows=max_rows),
        inputs_embeds=x,
        eos_ids=[],
        generators=[torch.Generator().manual_seed(seed) for _ in batch],
        should_stop=lambda row, tokens, token: token == STOP,
        prompt_tokens=[ids for ids, _ in batch],
        earlier_outputs=earlier,
    )


def _earlier(model) -> list[list[list[int]]]:
    """What the backend generated before for the same token ids, under other soft prompts and seeds."""
    return [
        [tokens for tokens, _ in _run(model, [(ids, soft)], 0, seed=99)]
        for ids, soft in zip(PROMPTS, _soft_prompts(2), strict=True)
    ]


@pytest.mark.parametrize("lookup", [0, 3])
def test_a_prompts_rows_are_the_same_alone_or_beside_other_prompts(model, lookup):
    batch, earlier = list(zip(PROMPTS, _soft_prompts(1), strict=True)), _earlier(model)
    together = _run(model, batch, lookup, earlier)
    alone = [row for i, b in enumerate(batch) for row in _run(model, [b], lookup, [earlier[i]])]
    assert {reason for _, reason in together} == {"answer", "length"}  # rows did end at different steps
    assert together == alone


def test_one_row_per_prompt_gets_the_tokens_plain_sampling_gives(model):
    batch = list(zip(PROMPTS, _soft_prompts(1), strict=True))
    assert _run(model, batch, 3, n=1) == _run(model, batch, 0, n=1)


def test_n_rows_get_the_tokens_plain_sampling_gives(model):
    batch = list(zip(PROMPTS, _soft_prompts(1), strict=True))
    assert _run(model, batch, 3) == _run(model, batch, 0)


def test_a_fresh_backend_with_the_same_seed_replays_a_step(model):
    batch = list(zip(PROMPTS, _soft_prompts(1), strict=True))
    assert _run(model, batch, 3, _earlier(model)) == _run(model, batch, 3, ())


def test_a_call_with_more_rows_than_lookup_max_rows_decodes_one_token_a_forward(model):
    """Wide forwards cost more than drafts save in a big batch, so such a call drafts nothing; its
    tokens are plain sampling's either way."""
    batch = list(zip(PROMPTS, _soft_prompts(1), strict=True))  # 3 prompts x 8 rows
    widths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(
            (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape[1]
        ),
        with_kwargs=True,
    )
    try:
        plain = _run(model, batch, 0)
        widths.clear()
        capped = _run(model, batch, 3, max_rows=16)
        capped_widths = widths[1:]  # after the prefill
        widths.clear()
        drafted = _run(model, batch, 3, max_rows=24)
        drafted_widths = widths[1:]
    finally:
        handle.remove()
    assert capped == plain == drafted
    assert set(capped_widths) == {1}
    assert max(drafted_widths) > 1  # within the cap, rows are fed drafts
