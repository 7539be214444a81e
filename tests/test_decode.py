"""The sampling loop (elm_memory/backends/decode.py) against model.generate, on real SmolLM2 fp32 weights."""

from __future__ import annotations

import pytest
import torch

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.backends.prompting import PromptBuilder

pytestmark = pytest.mark.model
# no lever and both levers by default; each lever alone in the extended run (pytest -m extended)
# the default run takes the product's defaults, both levers on; the rest are extended (and (False, False) is the
# sampling test's own reference, so there it could not fail)
LEVERS = [
    (s, d) if (s, d) == (True, True) else pytest.param(s, d, marks=(pytest.mark.slow, pytest.mark.extended))
    for s in (False, True)
    for d in (False, True)
]


@pytest.fixture(scope="module")
def batch(tiny_loaded):
    pb = PromptBuilder(tiny_loaded.tokenizer)
    ids = [list(pb.build(q).token_ids) for q in ("What is 2+3?", "Tom has 3 apples and buys 4 more. How many?")]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return ids, input_ids, mask


def _eos(loaded):
    return [loaded.tokenizer.eos_token_id]


@pytest.mark.parametrize("share, drop", LEVERS)
def test_greedy_matches_model_generate_with_every_lever(tiny_loaded, batch, share, drop):
    from transformers import GenerationConfig

    _, input_ids, mask = batch
    cfg = GenerationConfig(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=_eos(tiny_loaded))
    ref = tiny_loaded.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)
    ref = ref[:, input_ids.shape[1] :].tolist()
    out = sample(
        tiny_loaded.model,
        mask,
        DecodeOptions(24, share_prompt_kv=share, drop_finished=drop),
        input_ids=input_ids,
        eos_ids=_eos(tiny_loaded),
    )
    assert len(out) == 2
    for (tokens, reason), expected in zip(out, ref, strict=True):
        assert tokens == expected[: len(tokens)] and len(tokens) > 0
        assert reason in ("stop", "length")


def _sampled(loaded, input_ids, mask, seeds, **levers):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return sample(
        loaded.model,
        mask,
        # top_p < 1, as in the lookup test below: a batch changes logits in their last bits, and over the full
        # vocabulary's tail (thousands of tiny tokens, so thousands of CDF edges) about one draw in a
        # thousand lands on the other side of an edge; seeds 1 and 2 met one such draw
        DecodeOptions(32, temperature=0.8, top_p=0.95, n=4, **levers),
        input_ids=input_ids,
        eos_ids=_eos(loaded),
        generators=gens,
    )


def test_a_prompts_samples_depend_on_its_own_seed_not_on_its_batch(tiny_loaded, batch):
    ids, input_ids, mask = batch
    both = _sampled(tiny_loaded, input_ids, mask, [1, 2])
    alone = _sampled(tiny_loaded, torch.tensor([ids[1]]), torch.ones(1, len(ids[1]), dtype=torch.long), [2])
    assert [t for t, _ in both[4:]] == [t for t, _ in alone]
    assert len({tuple(t) for t, _ in both[4:]}) > 1  # four samples, not four copies
    other_seed = _sampled(tiny_loaded, input_ids, mask, [1, 3])
    assert [t for t, _ in other_seed[:4]] == [t for t, _ in both[:4]]
    assert [t for t, _ in other_seed[4:]] != [t for t, _ in both[4:]]


@pytest.mark.parametrize("share, drop", LEVERS)
def test_levers_do_not_change_what_is_sampled(tiny_loaded, batch, share, drop):
    _, input_ids, mask = batch
    reference = _sampled(tiny_loaded, input_ids, mask, [5, 6], share_prompt_kv=False, drop_finished=False)
    assert _sampled(tiny_loaded, input_ids, mask, [5, 6], share_prompt_kv=share, drop_finished=drop) == reference


def test_should_stop_ends_a_row_with_reason_answer(tiny_loaded, batch):
    _, input_ids, mask = batch
    stop_after = {0: 3, 1: 5}  # row -> tokens after which the callback stops it
    out = sample(
        tiny_loaded.model,
        mask,
        DecodeOptions(20, share_prompt_kv=True, drop_finished=True),
        input_ids=input_ids,
        eos_ids=[],
        should_stop=lambda row, toks, tok: len(toks) >= stop_after[row],
    )
    assert [(len(t), r) for t, r in out] == [(3, "answer"), (5, "answer")]


def test_backend_decode_paths_agree_greedily_and_seeds_reproduce(tiny_loaded, batch):
    from elm_memory.backends.base import PromptInput, SamplingParams
    from elm_memory.backends.hf import HFBackend

    ids, _, _ = batch
    prompts = [PromptInput(tuple(x)) for x in ids]
    loop, reference = HFBackend(tiny_loaded), HFBackend(tiny_loaded, decode_loop="generate")
    greedy = SamplingParams(max_new_tokens=16)
    assert [[g.token_ids for g in gs] for gs in loop.generate(prompts, greedy)] == [
        [g.token_ids for g in gs] for gs in reference.generate(prompts, greedy)
    ]
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, n=3, seed=7)
    for backend in (loop, reference):
        first = [[g.token_ids for g in gs] for gs in backend.generate(prompts, sampled)]
        again = [[g.token_ids for g in gs] for gs in backend.generate(prompts, sampled)]
        assert first == again and len({tuple(t) for t in first[0]}) > 1
    # one prompt's samples do not depend on its batch-mate (seed + i * n, as vLLM)
    [alone] = loop.generate([PromptInput(tuple(ids[1]), seed=7 + 3)], sampled)
    both = loop.generate(prompts, sampled)
    assert [g.token_ids for g in alone] == [g.token_ids for g in both[1]]


# ---- speculative decoding with lookup drafts ---------------------------------------------------


def _forwards(model):
    """A counter of the model's forward calls (a hook; remove it with .remove())."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("share", (False, pytest.param(True, marks=(pytest.mark.slow, pytest.mark.extended))))
def test_lookup_keeps_greedy_tokens_in_fewer_forwards(tiny_loaded, batch, share):
    _, input_ids, mask = batch
    plain_calls, h = _forwards(tiny_loaded.model)
    plain = sample(tiny_loaded.model, mask, DecodeOptions(48, share_prompt_kv=share), input_ids=input_ids, eos_ids=[])
    h.remove()
    calls, h = _forwards(tiny_loaded.model)
    looked = sample(
        tiny_loaded.model,
        mask,
        DecodeOptions(48, share_prompt_kv=share, lookup_draft_tokens=5),
        input_ids=input_ids,
        eos_ids=[],
    )
    h.remove()
    assert looked == plain  # fp32: a forward of several tokens gives the same argmax here
    assert [len(t) for t, _ in looked] == [48, 48]
    assert len(calls) < len(plain_calls)  # drafts were accepted: fewer steps for the same tokens


def test_lookup_sampling_is_seeded_per_prompt_and_stops_where_told(tiny_loaded, batch):
    ids, input_ids, mask = batch

    def run(inp, m, seeds, stop=None):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return sample(
            tiny_loaded.model,
            m,
            # top_p < 1: the inverse-CDF draw over a full fp32 vocabulary flips a tail token now and then when the
            # batch changes a logit in its last bits; a nucleus keeps the draw off that tail
            DecodeOptions(32, temperature=0.8, top_p=0.9, n=4, lookup_draft_tokens=4),
            input_ids=inp,
            eos_ids=_eos(tiny_loaded),
            generators=gens,
            should_stop=stop,
        )

    both = run(input_ids, mask, [1, 2])
    assert run(input_ids, mask, [1, 2]) == both
    alone = run(torch.tensor([ids[1]]), torch.ones(1, len(ids[1]), dtype=torch.long), [2])
    assert [t for t, _ in both[4:]] == [t for t, _ in alone]  # drafts only from rows of the same prompt text
    assert len({tuple(t) for t, _ in both[4:]}) > 1
    stopped = run(input_ids, mask, [1, 2], stop=lambda row, toks, tok: len(toks) >= 3 + row)
    assert [(len(t), r) for t, r in stopped] == [(3 + row, "answer") for row in range(8)]


def test_lookup_acceptance_draws_exactly_from_the_models_distribution():
    """Accept draft d with probability p(d), else sample p without d: the token that comes out is
    distributed as p itself (here on a 5-token vocabulary, 40000 seeded draws)."""
    from elm_memory.backends.decode import _verify

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits[0] / 0.8, dim=-1)
    counts = torch.zeros(5)
    for key in range(40000):  # one row per key, each at its first token
        took, nxt = _verify(logits, [1], DecodeOptions(8, temperature=0.8), key, 0)
        counts[took[0] if took else nxt] += 1
    assert torch.allclose(counts / counts.sum(), p, atol=0.01)
    greedy = _verify(logits, [0], DecodeOptions(8), 0, 0)
    assert greedy == ([0], 0)  # argmax 0 accepted, then the next position's argmax
    assert _verify(logits, [1], DecodeOptions(8), 0, 0) == ([], 0)


def test_the_backend_drafts_from_what_it_generated_before_for_the_same_prompt(tiny_loaded, batch):
    from elm_memory.backends.base import PromptInput, SamplingParams
    from elm_memory.backends.hf import HFBackend

    ids, _, _ = batch
    prompts = [PromptInput(tuple(x)) for x in ids]
    greedy = SamplingParams(max_new_tokens=40)
    plain = [[g.token_ids for g in gs] for gs in HFBackend(tiny_loaded).generate(prompts, greedy)]
    backend = HFBackend(tiny_loaded, lookup_draft_tokens=4)
    first_calls, h = _forwards(tiny_loaded.model)
    first = [[g.token_ids for g in gs] for gs in backend.generate(prompts, greedy)]
    h.remove()
    again_calls, h = _forwards(tiny_loaded.model)
    again = [[g.token_ids for g in gs] for gs in backend.generate(prompts, greedy)]
    h.remove()
    assert first == plain and again == plain
    # the second time the first answer is there to copy: nearly every draft is accepted
    assert len(again_calls) < len(first_calls)
    assert len(again_calls) <= 1 + 40 // 5 + 2
    assert backend.recent.get([ids[0]])[0] == [first[0][0], again[0][0]]


def test_the_generate_loop_refuses_lookup_drafts_it_cannot_apply(tiny_loaded):
    from elm_memory.backends.hf import HFBackend

    with pytest.raises(ValueError, match="lookup_draft_tokens needs decode_loop='elm'"):
        HFBackend(tiny_loaded, decode_loop="generate", lookup_draft_tokens=2)
    assert HFBackend(tiny_loaded, decode_loop="generate").lookup_draft_tokens == 0
