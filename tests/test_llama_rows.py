"""The llama.cpp one-row engine (``backend.one_row_engine: llama``, elm_memory/backends/llama_rows.py) on SmolLM2's
packaged Q4_1 GGUF, against the plain loop on the same GGUF dequantized.

Tolerances. The plain loop multiplies float32 activations by the dequantized weights; llama.cpp multiplies the
4-bit blocks by activations it quantizes to 8 bits, so logits differ by a little and tokens may part after a few
steps. The tests compare what must agree: the first token of clear prompts, logits within a loose bound, the
direction a LoRA moves the logits, and the engine's own determinism. Needs the optional extra (a source build):
skipped without it, as docs/testing.md says."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama extra is not installed (docs/testing.md)")
pytestmark = pytest.mark.model

from elm_memory.backends import llama_rows  # noqa: E402
from elm_memory.backends.base import PromptInput, SamplingParams  # noqa: E402
from elm_memory.backends.decode import DecodeOptions  # noqa: E402
from elm_memory.backends.hf import HFBackend  # noqa: E402
from elm_memory.backends.prompting import PromptBuilder  # noqa: E402
from elm_memory.memory.lora import LoraAdapter  # noqa: E402
from elm_memory.memory.prefix import question_prefix  # noqa: E402
from elm_memory.models.prepare import source_gguf  # noqa: E402

QUESTIONS = ["What is 2 + 3?", "Name the capital of France.", "Count from one to five."]


@pytest.fixture(scope="module")
def engine(smol, tmp_path_factory):
    gguf, _ = source_gguf(smol.info.path)
    assert gguf is not None
    rows = llama_rows.LlamaRows(gguf, threads=1, adapter_dir=tmp_path_factory.mktemp("adapters"), context_per_row=256)
    yield rows
    rows.close()


@pytest.fixture(scope="module")
def prompts(smol):
    builder = PromptBuilder(smol.tokenizer)
    return [builder.build(q) for q in QUESTIONS]


def _plain_logits(smol, ids, lora=None):
    x = torch.tensor([ids])
    with torch.no_grad():
        if lora is None:
            return smol.model(input_ids=x).logits[0, -1].float()
        with lora.apply(smol.model, 1):
            return smol.model(input_ids=x).logits[0, -1].float()


def _prefill(engine, prompts, lora=None):
    engine.use_lora(lora)
    engine.lc.llama_memory_clear(engine.lc.llama_get_memory(engine.ctx), True)
    return torch.from_numpy(engine._prefill(prompts))


def test_the_gguf_in_llama_cpp_gives_the_plain_loops_logits_within_its_quantized_products(smol, engine, prompts):
    ids = [list(p.token_ids) for p in prompts]
    ours = torch.cat([_prefill(engine, ids[:2]), _prefill(engine, ids[2:])])  # two rows at a time
    for row, tokens in enumerate(ids):
        plain = _plain_logits(smol, tokens)
        assert ours[row].argmax() == plain.argmax()
        assert torch.corrcoef(torch.stack([ours[row], plain]))[0, 1] > 0.99


def test_input_embeddings_stand_for_their_tokens(smol, engine, prompts):
    ids = [list(p.token_ids) for p in prompts[:2]]
    table = smol.model.get_input_embeddings().weight.detach().float().numpy()
    by_tokens = _prefill(engine, ids)
    by_rows = _prefill(engine, [table[t] for t in ids])
    assert torch.equal(by_tokens.argmax(-1), by_rows.argmax(-1))
    assert (by_tokens - by_rows).abs().max() < 0.5  # the GGUF's own table against its dequantized copy


def test_a_lora_moves_the_logits_as_the_plain_loops_hooks_do(smol, engine, prompts):
    # llama.cpp quantizes activations to 8 bits before each 4-bit product, so any change to a layer's output moves
    # the logits by a noise floor of its own; a LoRA large enough to stand above it shows its direction and size
    start = LoraAdapter.initial(smol.model, rank=16, alpha=32, seed=0, targets=("v_proj", "up_proj"))
    g = torch.Generator().manual_seed(1)
    middle = {n: (a, torch.randn(b.shape, generator=g) * 0.2) for n, (a, b) in start.weights.items() if ".15." in n}
    lora = LoraAdapter(middle, 32)
    zero = LoraAdapter({n: (a, torch.zeros_like(b)) for n, (a, b) in middle.items()}, 32)
    tokens = list(prompts[0].token_ids)
    base = _prefill(engine, [tokens])[0]
    assert torch.equal(_prefill(engine, [tokens], zero)[0], base)  # B = 0: the base model exactly
    ours = _prefill(engine, [tokens], lora)[0] - base
    theirs = _plain_logits(smol, tokens, lora) - _plain_logits(smol, tokens)
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.6  # a transposed or misplaced B: about 0
    assert 0.4 < ours.norm() / theirs.norm() < 2.5  # alpha / r, not alpha: a 2x scale, not 32x
    loads = engine.adapter_loads
    _prefill(engine, [tokens], LoraAdapter(dict(middle), 32))  # the same content: no new file, no reload
    assert engine.adapter_loads == loads and not list(engine.adapter_dir.iterdir())  # loaded, then removed
    assert torch.equal(_prefill(engine, [tokens])[0], base)  # no LoRA: the base model again


def test_greedy_rows_decode_alone_as_together_and_stop_where_told(engine, prompts):
    ids = [list(p.token_ids) for p in prompts[:2]]
    greedy = DecodeOptions(max_new_tokens=12)
    together = engine.sample(ids, [greedy, greedy], eos_ids=[])
    alone = [engine.sample([p], [greedy], eos_ids=[])[0] for p in ids]
    assert together == alone and all(len(t) == 12 and r == "length" for t, r in together)
    first = together[0][0][0]
    stopped = engine.sample(ids[:1], [greedy], eos_ids=[first])
    assert stopped == [([first], "stop")]
    calls = []

    def at_third(row, tokens, token):
        calls.append(row)
        return len(tokens) == 3

    answer = engine.sample(ids[:1], [greedy], should_stop=at_third)
    assert answer == [(together[0][0][:3], "answer")] and calls == [0, 0, 0]


def test_seeded_samples_repeat_and_differ_by_seed(engine, prompts):
    ids = [list(prompts[2].token_ids)]
    hot = DecodeOptions(max_new_tokens=16, temperature=1.0, n=2)

    def draw(seed):
        return engine.sample(ids, [hot], generators=[torch.Generator().manual_seed(seed)])

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    rows = draw(3)
    assert rows[0] != rows[1]  # each row its own key


def test_more_rows_than_it_takes_is_a_clear_error(engine, prompts):
    with pytest.raises(ValueError, match="at most 2 rows"):
        engine.sample([list(prompts[0].token_ids)], [DecodeOptions(max_new_tokens=2, n=3)])


def test_a_longer_call_grows_the_context(engine, prompts):
    ids = [list(prompts[0].token_ids)]
    before = engine.per_row
    out = engine.sample(ids, [DecodeOptions(max_new_tokens=before)], eos_ids=[])
    assert len(out[0][0]) == before and engine.per_row > before


# -- the backend -------------------------------------------------------------------------------------------


def test_the_backend_takes_llama_for_one_or_two_rows_and_the_plain_loop_otherwise(smol, caplog):
    backend = HFBackend(smol, one_row_engine="llama")
    assert backend.one_row_engine == "llama", backend.one_row_reason
    builder = PromptBuilder(smol.tokenizer)
    prompt = PromptInput(builder.build(QUESTIONS[0]).token_ids)
    answer = backend.generate([prompt], SamplingParams(max_new_tokens=8))[0][0]
    assert backend.engine_calls == {"llama": 1} and answer.token_ids
    plain = HFBackend(smol).generate([prompt], SamplingParams(max_new_tokens=8))[0][0]
    assert answer.token_ids[0] == plain.token_ids[0]
    backend.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.7, n=4, seed=1))
    assert backend.engine_calls["plain"] == 1  # four samples: the plain loop
    soft = torch.randn(3, smol.info.hidden_size) * 0.01
    with_soft = PromptInput(prompt.token_ids, soft_prompt=soft, soft_prompt_at=builder.build(QUESTIONS[0]).user_turn_at)
    backend.generate([with_soft], SamplingParams(max_new_tokens=4))
    assert backend.engine_calls["llama"] == 2
    q = tuple(smol.tokenizer("What is 1 + 1?", add_special_tokens=False)["input_ids"])
    prefix = question_prefix(smol, q, len(q))
    with caplog.at_level(logging.INFO, logger="elm_memory.backends.hf"):
        backend.generate([PromptInput(prompt.token_ids, memory=prefix)], SamplingParams(max_new_tokens=4))
    assert backend.engine_calls["plain"] == 2 and "llama.cpp serves soft prompts and one LoRA" in caplog.text


def test_llama_without_its_binding_falls_back_and_says_why(smol, monkeypatch):
    monkeypatch.setattr(llama_rows, "available", lambda: "llama_cpp does not import (test)")
    backend = HFBackend(smol, one_row_engine="llama")
    assert backend.one_row_engine == "plain" and "does not import (test)" in backend.one_row_reason
    auto = HFBackend(smol, one_row_engine="auto")
    assert (
        auto.one_row_engine in ("int4", "plain")
        and "llama.cpp: llama_cpp does not import (test)" in auto.one_row_reason
    )


def test_embeddings_of_the_wrong_width_are_refused(engine):
    with pytest.raises(ValueError, match="width"):
        engine.sample([np.zeros((3, 7), dtype=np.float32)], [DecodeOptions(max_new_tokens=1)])


def test_a_failing_llama_cpp_falls_back_to_the_plain_loop_once_and_says_why(smol, monkeypatch, caplog):
    backend = HFBackend(smol, one_row_engine="llama")

    def broken(*args, **kwargs):
        raise RuntimeError("llama_decode returned -1")

    monkeypatch.setattr(llama_rows.LlamaRows, "sample", broken)
    prompt = PromptInput(PromptBuilder(smol.tokenizer).build(QUESTIONS[0]).token_ids)
    with caplog.at_level(logging.WARNING, logger="elm_memory.backends.hf"):
        answers = [backend.generate([prompt], SamplingParams(max_new_tokens=4))[0][0] for _ in range(2)]
    assert all(a.token_ids for a in answers) and backend.engine_calls == {"plain": 2}
    assert backend.one_row_engine == "plain" and "llama_decode returned -1" in backend.one_row_reason
    assert sum("llama.cpp failed" in r.getMessage() for r in caplog.records) == 1
