"""Captured decode steps (elm_memory/backends/captured.py) give the plain loop's tokens.

On real SmolLM2 fp32 weights, the static cache, buckets and masks run uncompiled here
(``compile=False``): the same code the compiled step runs, minus the compiler. One slow test compiles
the step with inductor on the CPU; ``tests/test_cuda.py`` compiles it to CUDA graphs on a GPU.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from elm_memory.backends import packed_attention
from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.backends.captured import CapturedSteps
from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.backends.hf import HFBackend
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.memory.lora import LoraAdapter, target_linears
from elm_memory.memory.prefix import question_prefix

pytestmark = pytest.mark.model
QUESTIONS = ("What is 2+3?", "Tom has 3 apples and buys 4 more. How many apples does he have now?")


@pytest.fixture(scope="module")
def batch(smol):
    pb = PromptBuilder(smol.tokenizer)
    ids = [list(pb.build(q).token_ids) for q in QUESTIONS]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])  # left-padded: rows differ in length
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return ids, input_ids, mask


def _steps(loaded, **kw):
    return CapturedSteps(
        loaded.model,
        compile=False,
        max_rows=kw.pop("max_rows", 64),
        max_cache_len=kw.pop("L", 2048),
        read_every=kw.pop("read_every", None),
    )


@contextlib.contextmanager
def _attention(loaded, implementation):
    """The model on another attention implementation for the block (the CPU's pick is in hardware.py)."""
    config = loaded.model.config
    before = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def _stop_after(lengths):
    """Row r stops (reason "answer") after lengths[r] tokens: rows end at different steps."""
    return lambda row, tokens, tok: len(tokens) >= lengths[row]


def _both(loaded, mask, options, captured, seeds=None, **kw):
    """The plain loop's rows and the captured steps' rows for the same call (fresh generators each)."""
    out = []
    for steps in (None, captured):
        if seeds is not None:
            kw["generators"] = [torch.Generator().manual_seed(s) for s in seeds]
        out.append(sample(loaded.model, mask, options, captured=steps, **kw))
    return out[0], out[1]


@pytest.mark.parametrize("share, drop", [(True, True), (False, False), (True, False)])
def test_greedy_tokens_equal_the_plain_loops(smol, batch, share, drop):
    _, input_ids, mask = batch
    captured = _steps(smol)
    plain, fast = _both(
        smol, mask, DecodeOptions(20, share_prompt_kv=share, drop_finished=drop), captured, input_ids=input_ids
    )
    assert fast == plain and all(len(t) == 20 for t, _ in fast)
    assert captured.buckets_seen == [(2, 256)]  # 2 rows; prompt + 20 tokens fit the smallest cache


@pytest.mark.parametrize(
    "read_every, smaller",
    [
        (1, 4),
        pytest.param(4, 2, marks=(pytest.mark.slow, pytest.mark.extended)),
        pytest.param(7, 4, marks=(pytest.mark.slow, pytest.mark.extended)),
    ],
)
def test_seeded_samples_equal_the_plain_loops_while_rows_finish_and_move_to_smaller_buckets(
    smol, batch, read_every, smaller
):
    """8 sampled rows per prompt (16 rows); rows stop at different steps, finished rows stay masked in
    place and the live ones move down to a bucket four times smaller: every token is the plain loop's,
    also when the tokens are read back every few steps (rows ending inside those steps keep theirs)."""
    _, input_ids, mask = batch
    lengths = [3, 30, 5, 7, 2, 9, 4, 6, 30, 3, 8, 2, 5, 4, 6, 3]
    captured = _steps(smol, read_every=read_every)
    plain, fast = _both(
        smol,
        mask,
        DecodeOptions(30, temperature=0.8, n=8),
        captured,
        input_ids=input_ids,
        seeds=(11, 12),
        should_stop=_stop_after(lengths),
    )
    assert fast == plain
    assert [len(t) for t, _ in fast] == lengths and {r for _, r in fast} == {"answer"}
    # 16 rows; the host reads tokens 1, 1 + read_every, ...: at the first read with at most 4 rows live
    # (2 after 9 tokens with read_every 4, 3 after 8 with 1 or 7), they move to a bucket that holds them
    assert [b for b, _ in captured.buckets_seen] == [16, smaller]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("pack", [True, False])
def test_steps_read_each_key_value_head_once_and_keep_the_tokens(smol, batch, monkeypatch, pack, attention):
    """SmolLM2 has 9 query heads over 3 key/value heads: decode steps pack a group's query heads over
    their shared head (no copies of the cache), in the plain loop and, unless told not to, in the captured
    steps, with the same tokens."""
    _, input_ids, mask = batch
    packed = []
    for name in ("packed_sdpa", "packed_eager"):
        real = getattr(packed_attention, name)
        spy = lambda *a, real=real, **kw: packed.append(a[1].shape) or real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(packed_attention, name, spy)
    with _attention(smol, attention):
        captured = CapturedSteps(smol.model, compile=False, max_rows=64, max_cache_len=2048, pack_query_heads=pack)
        plain, fast = _both(smol, mask, DecodeOptions(6), captured, input_ids=input_ids)
    assert fast == plain
    layers = smol.model.config.num_hidden_layers
    # 5 decode steps a call (the first token comes from the prefill): the plain loop's, then the captured's
    assert len(packed) == 5 * layers * (2 if pack else 1)
    assert all(shape == (2, 9, 1, 64) for shape in packed)


def test_the_eager_attention_takes_an_additive_mask_and_keeps_the_tokens(smol, batch):
    """sdpa takes the boolean mask as it is; the eager attention adds it, so it gets 0 / dtype-min."""
    _, input_ids, mask = batch
    with _attention(smol, "eager"):
        captured = _steps(smol)
        assert captured._additive
        plain, fast = _both(smol, mask, DecodeOptions(10), captured, input_ids=input_ids)
    assert fast == plain


def test_a_soft_prompt_in_the_prefill_decodes_as_in_the_plain_loop(smol, batch):
    ids, _, mask = batch
    embed = smol.model.get_input_embeddings()
    torch.manual_seed(0)
    soft = torch.randn(5, embed.weight.shape[1]) * embed.weight.std()
    rows = [torch.cat([soft, embed(torch.tensor(x))]) for x in ids]
    width = max(r.shape[0] for r in rows)
    embeds = torch.zeros(len(rows), width, soft.shape[1])
    full_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        embeds[i, width - r.shape[0] :] = r
        full_mask[i, width - r.shape[0] :] = 1
    with torch.no_grad():
        plain, fast = _both(smol, full_mask, DecodeOptions(16), _steps(smol), inputs_embeds=embeds)
    assert fast == plain


def test_a_prefix_memory_decodes_as_in_the_plain_loop_and_lora_takes_the_plain_loop(smol, batch):
    ids, input_ids, mask = batch
    prefix = question_prefix(smol, ids[0], 4)
    captured = _steps(smol)
    plain, fast = _both(smol, mask, DecodeOptions(12), captured, input_ids=input_ids, memory=prefix)
    assert fast == plain and captured.buckets_seen

    linears = target_linears(smol.model)
    torch.manual_seed(1)
    lora = LoraAdapter(
        {n: (torch.randn(2, m.in_features) * 0.01, torch.randn(m.out_features, 2) * 0.01) for n, m in linears.items()},
        alpha=4.0,
    )
    untouched = _steps(smol)
    plain, fast = _both(smol, mask, DecodeOptions(12), untouched, input_ids=input_ids, memory=lora)
    assert fast == plain and untouched.buckets_seen == []  # hooks run every forward: never captured


def test_zero_new_tokens_decode_nothing_on_either_path(smol, batch):
    _, input_ids, mask = batch
    captured = _steps(smol, read_every=4)
    plain, fast = _both(smol, mask, DecodeOptions(0, temperature=0.8, n=2), captured, input_ids=input_ids, seeds=(1, 2))
    assert fast == plain == [([], "length")] * 4 and captured.buckets_seen == []


def test_read_every_below_one_is_refused(smol):
    with pytest.raises(ValueError, match="read_every"):
        _steps(smol, read_every=0)


def test_a_call_no_bucket_fits_is_decoded_by_the_plain_loop_with_one_log_line(smol, batch, caplog):
    _, input_ids, mask = batch
    captured = _steps(smol, L=128)  # no cache bucket is that short
    with caplog.at_level(logging.INFO, logger="elm_memory.backends.captured"):
        for _ in range(2):
            out = sample(smol.model, mask, DecodeOptions(3), input_ids=input_ids, captured=captured)
    assert captured.buckets_seen == [] and len(out) == 2
    lines = [r for r in caplog.records if "fit no bucket" in r.getMessage()]
    assert len(lines) == 1, "logged once per process, not per call"


def test_a_failed_graph_capture_warns_once_and_decodes_the_same_tokens_without_graphs(smol, batch, caplog, monkeypatch):
    """Capturing a CUDA graph can fail (a driver, an operation that cannot be captured); the steps then
    run uncaptured on the same slots. Here the capture is made to fail on purpose."""
    _, input_ids, mask = batch
    captured = _steps(smol, read_every=4)
    captured.graphs = True  # as on a GPU with compiling on

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", refuse)
    options = DecodeOptions(12, temperature=0.8, n=4)
    with caplog.at_level(logging.WARNING, logger="elm_memory.backends.captured"):
        for _ in range(2):
            plain, fast = _both(smol, mask, options, captured, input_ids=input_ids, seeds=(3, 4))
            assert fast == plain
    assert captured._graph_failure is not None and "not permitted" in captured._graph_failure
    assert len([r for r in caplog.records if "capturing a CUDA graph failed" in r.getMessage()]) == 1


def test_a_call_while_another_holds_the_caches_takes_the_plain_loop(smol, batch):
    """A background learner's rollouts beside the answer path: the second call never shares a static cache."""
    _, input_ids, mask = batch
    captured = _steps(smol)
    with captured._busy:  # another call is decoding
        busy = sample(smol.model, mask, DecodeOptions(6), input_ids=input_ids, captured=captured)
    assert captured.buckets_seen == []
    assert busy == sample(smol.model, mask, DecodeOptions(6), input_ids=input_ids, captured=captured)
    assert captured.buckets_seen == [(2, 256)] and not captured._busy.locked()


def test_the_backend_switch_resolves_per_device_and_refuses_unknown_values(smol):
    assert HFBackend(smol)._captured_mode == "off"  # auto on a CPU
    assert HFBackend(smol, decode_graphs="static")._captured_mode == "static"
    assert HFBackend(smol, decode_graphs="on", lookup_draft_tokens=2)._captured_mode == "off"
    with pytest.raises(ValueError, match="decode_graphs"):
        HFBackend(smol, decode_graphs="yes")


def test_the_backend_answers_and_rolls_out_the_same_through_captured_steps(smol):
    """ELM's two paths end to end: a greedy answer pair (stop at the boxed answer) and 4 seeded rollouts."""
    pb = PromptBuilder(smol.tokenizer)
    prompt = PromptInput(pb.build(QUESTIONS[1]).token_ids)
    plain, fast = HFBackend(smol, decode_graphs="off"), HFBackend(smol, decode_graphs="static")
    for params in (
        SamplingParams(max_new_tokens=24, stop_at_answer=True),
        SamplingParams(max_new_tokens=24, temperature=0.8, n=4, seed=3, stop_at_answer=True),
    ):
        a, b = plain.generate([prompt, prompt], params), fast.generate([prompt, prompt], params)
        assert [[g.token_ids for g in gens] for gens in a] == [[g.token_ids for g in gens] for gens in b]
    assert fast._captured is not None and fast._captured.buckets_seen


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])  # both with packed query heads, compiled
def test_the_step_compiled_with_inductor_on_the_cpu_keeps_greedy_tokens(smol, batch, attention):
    _, input_ids, mask = batch
    with _attention(smol, attention):
        captured = CapturedSteps(smol.model, compile=True, max_rows=8, max_cache_len=2048)
        assert captured.pack_query_heads
        for _ in range(2):  # the second call replays what the first compiled
            plain, fast = _both(smol, mask, DecodeOptions(12), captured, input_ids=input_ids)
            assert fast == plain
