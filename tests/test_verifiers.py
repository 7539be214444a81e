"""Verifiers: self-certainty and logprob on real SmolLM2 weights (fp32), the PRM scoring
code on a tiny randomly initialised Qwen2 token classifier, and config/plugin selection."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import types

import pytest
import torch

from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.errors import BackendError, ConfigError
from elm_memory.verifiers import EMPTY_SCORE, Candidate, Verifier, build_verifier
from elm_memory.verifiers.logprob import LogprobVerifier
from elm_memory.verifiers.prm import (
    PRMVerifier,
    aggregate_rewards,
    format_prm_text,
    split_steps,
    step_rewards,
)
from elm_memory.verifiers.self_certainty import SelfCertaintyVerifier

pytestmark = pytest.mark.model
QUESTION = "What is 2+3?"


# ---- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(tiny_loaded) -> PromptInput:
    return PromptInput(PromptBuilder(tiny_loaded.tokenizer).build(QUESTION).token_ids)


@pytest.fixture(scope="module")
def greedy_and_random(tiny_backend, prompt):
    [[gen]] = tiny_backend.generate([prompt], SamplingParams(max_new_tokens=16))
    greedy = tuple(gen.token_ids)
    assert len(greedy) >= 8
    g = torch.Generator().manual_seed(0)
    low = len(tiny_backend.tokenizer.all_special_ids) + 50  # skip special/control tokens
    rand = tuple(torch.randint(low, tiny_backend.info.vocab_size, (len(greedy),), generator=g).tolist())
    return greedy, rand


def _raw_response_logprobs(model, prompt: PromptInput, response, embed=None) -> torch.Tensor:
    """Independent reference: full logits of prompt+response, log-softmax, response rows (n, V)."""
    with torch.no_grad():
        if prompt.soft_prompt is None:
            ids = torch.tensor([list(prompt.token_ids) + list(response)])
            logits = model(input_ids=ids).logits[0]
        else:
            table = model.get_input_embeddings()
            at = prompt.soft_prompt_at
            toks = torch.tensor(list(prompt.token_ids))
            resp = table(torch.tensor(list(response)))
            emb = torch.cat([table(toks[:at]), prompt.soft_prompt, table(toks[at:]), resp])
            logits = model(inputs_embeds=emb.unsqueeze(0)).logits[0]
    n = len(response)
    return torch.log_softmax(logits[-(n + 1) : -1].double(), dim=-1)


# ---- self-certainty and logprob on SmolLM2 --------------------------------------------


@pytest.fixture(scope="module")
def scored(tiny_backend, prompt, greedy_and_random):
    """Both verifiers on [greedy, random] once (forwards are the slow part on 2 cores)."""
    cands = [Candidate("", r, prompt) for r in greedy_and_random]
    return {
        "self_certainty": SelfCertaintyVerifier(tiny_backend).score(QUESTION, cands),
        "logprob": LogprobVerifier(tiny_backend).score(QUESTION, cands),
    }


def test_self_certainty_and_logprob_match_raw_logits(tiny_backend, tiny_loaded, prompt, greedy_and_random, scored):
    for i, resp in enumerate(greedy_and_random):
        lp = _raw_response_logprobs(tiny_loaded.model, prompt, resp)
        vocab = lp.shape[-1]
        # KL(U || p) = sum_v 1/V * log((1/V) / p_v), written out directly
        kl = ((1.0 / vocab) * (-math.log(vocab) - lp)).sum(-1)
        assert scored["self_certainty"][i] == pytest.approx(kl.mean().item(), rel=1e-4, abs=1e-4)
        ref = lp.gather(1, torch.tensor(resp).unsqueeze(1)).mean().item()
        assert scored["logprob"][i] == pytest.approx(ref, rel=1e-4, abs=1e-4)
    [backend_lp] = tiny_backend.token_logprobs(prompt, [greedy_and_random[0]])
    assert scored["logprob"][0] == pytest.approx(sum(backend_lp) / len(backend_lp), rel=1e-4, abs=1e-4)


def test_greedy_response_beats_random_tokens(scored):
    sc, lp = scored["self_certainty"], scored["logprob"]
    assert sc[0] > sc[1] > 0.0  # KL from uniform is positive for any non-uniform distribution
    assert lp[0] > lp[1]


def test_plain_conditioning_ignores_the_soft_prompt_own_uses_it(
    tiny_backend, tiny_loaded, prompt, greedy_and_random, scored
):
    greedy, _ = greedy_and_random
    g = torch.Generator().manual_seed(1)
    soft = torch.randn(4, tiny_loaded.info.hidden_size, generator=g) * 0.02
    with_memory = PromptInput(prompt.token_ids, soft_prompt=soft, soft_prompt_at=0)
    memory_cand = Candidate("", greedy, with_memory, kind="memory")
    [s_mem_plain] = SelfCertaintyVerifier(tiny_backend).score(QUESTION, [memory_cand])
    [s_mem_own] = SelfCertaintyVerifier(tiny_backend, conditioning="own").score(QUESTION, [memory_cand])
    s_zero = scored["self_certainty"][0]
    assert s_mem_plain == pytest.approx(s_zero, abs=1e-6)
    lp = _raw_response_logprobs(tiny_loaded.model, with_memory, greedy)
    ref = (-math.log(lp.shape[-1]) - lp.mean(-1)).mean().item()
    assert s_mem_own == pytest.approx(ref, rel=1e-4, abs=1e-4)
    assert abs(s_mem_own - s_zero) > 1e-4


def test_text_only_candidate_is_tokenised_under_the_plain_prompt(tiny_backend, tiny_loaded, greedy_and_random, scored):
    greedy, _ = greedy_and_random
    text = tiny_loaded.tokenizer.decode(greedy)
    assert tuple(tiny_loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) == greedy  # round-trips
    [s] = LogprobVerifier(tiny_backend).score(QUESTION, [Candidate(text)])
    assert s == pytest.approx(scored["logprob"][0], rel=1e-5)
    assert Candidate(text, list(greedy)).token_ids == greedy  # lists (Generation.token_ids) become tuples


def test_empty_responses_score_minus_inf_without_crashing(tiny_backend, prompt):
    one = (prompt.token_ids[-1],)
    for cls in (SelfCertaintyVerifier, LogprobVerifier):
        cands = [Candidate("", (), prompt), Candidate("", one, prompt), Candidate("")]
        scores = cls(tiny_backend).score(QUESTION, cands)
        assert scores[0] == EMPTY_SCORE == scores[2] == -math.inf
        assert math.isfinite(scores[1]) and scores[1] > scores[0]


def test_long_response_is_truncated_to_the_context(tiny_backend, prompt, greedy_and_random, caplog):
    greedy, rand = greedy_and_random
    room = 10
    small = types.SimpleNamespace(
        model=tiny_backend.model,
        tokenizer=tiny_backend.tokenizer,
        info=dataclasses.replace(tiny_backend.info, max_context=len(prompt.token_ids) + room),
    )
    long = greedy + rand
    with caplog.at_level("WARNING"):
        [cut] = SelfCertaintyVerifier(small).score(QUESTION, [Candidate("", long, prompt)])
    [head] = SelfCertaintyVerifier(tiny_backend).score(QUESTION, [Candidate("", long[:room], prompt)])
    assert cut == pytest.approx(head, rel=1e-5)
    assert "exceed the context" in caplog.text
    no_room = types.SimpleNamespace(
        **{**vars(small), "info": dataclasses.replace(small.info, max_context=len(prompt.token_ids))}
    )
    assert LogprobVerifier(no_room).score(QUESTION, [Candidate("", greedy, prompt)]) == [EMPTY_SCORE]


def test_scoring_runs_in_eval_mode_without_grad_and_restores_the_mode(tiny_backend, prompt, greedy_and_random, scored):
    model = tiny_backend.model
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append((m.training, torch.is_grad_enabled())))
    model.train()
    try:
        [s] = LogprobVerifier(tiny_backend).score(QUESTION, [Candidate("", greedy_and_random[0], prompt)])
        assert model.training  # restored
    finally:
        model.eval()
        hook.remove()
    assert seen == [(False, False)]
    assert s == pytest.approx(scored["logprob"][0], rel=1e-6)
    assert torch.is_grad_enabled()


# ---- selection by config and plugins -------------------------------------------------


def test_config_string_selects_the_verifier(tiny_backend):
    v = build_verifier(ELMConfig.load(overrides={"verifier": {"name": "logprob"}}), tiny_backend)
    assert isinstance(v, LogprobVerifier) and isinstance(v, Verifier) and v.name == "logprob"
    v = build_verifier(ELMConfig.load(preset="cpu-tiny"), tiny_backend)
    assert isinstance(v, SelfCertaintyVerifier)
    prm = build_verifier(ELMConfig.load(), None)  # the paper default; nothing is loaded yet
    assert isinstance(prm, PRMVerifier) and not prm.loaded
    assert prm.model_name == "Qwen/Qwen2.5-Math-PRM-7B" and prm.aggregate == "min" and prm.trust_remote_code


def test_policy_verifier_without_a_model_is_a_clear_error():
    with pytest.raises(BackendError, match="needs the policy model"):
        build_verifier(ELMConfig.load(overrides={"verifier": {"name": "self_certainty"}}), None)


def test_unknown_verifier_lists_available_names():
    # refused when the config loads, before any model or verifier is built
    with pytest.raises(ConfigError) as err:
        ELMConfig.load(overrides={"verifier": {"name": "oracle"}})
    msg = str(err.value)
    assert "oracle" in msg and all(n in msg for n in ("logprob", "prm", "self_certainty"))


class PluginVerifier:
    """A third-party verifier: prefers shorter responses."""

    name = "shortest"

    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend

    def score(self, question, responses):
        return [-float(len(c.text)) for c in responses]


def test_entry_point_plugin_is_discovered(monkeypatch):
    from elm_memory import plugins
    from elm_memory.verifiers.registry import verifiers

    ep = importlib.metadata.EntryPoint(
        name="shortest", value=f"{__name__}:PluginVerifier", group="elm_memory.verifiers"
    )

    def fake_entry_points(*, group=None, **kw):
        return [ep] if group == "elm_memory.verifiers" else []

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(verifiers, "_entries", dict(verifiers._entries))
    monkeypatch.setattr(verifiers, "_plugins_loaded", False)
    assert "shortest" in verifiers.names()
    v = build_verifier(ELMConfig.load(overrides={"verifier": {"name": "shortest"}}), backend="sentinel")
    assert isinstance(v, PluginVerifier) and v.backend == "sentinel"
    assert v.score("q", [Candidate("long answer"), Candidate("x")]) == [-11.0, -1.0]


# ---- PRM -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prm_parts(tiny_loaded):
    """A tiny random Qwen2 token classifier (2 labels) and SmolLM2's tokenizer plus <extra_0>."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForTokenClassification

    tok = AutoTokenizer.from_pretrained(tiny_loaded.info.path)  # a fresh copy: the shared one stays untouched
    tok.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=2,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForTokenClassification(cfg).eval()
    with torch.no_grad():  # make the head's logits spread out so probabilities differ per step
        model.score.weight.mul_(50.0)
    return model, tok


STEPS_TEXT = "First, 2 + 3 means adding.\n\nSo 2 + 3 = 5.\n \n\n\nThe answer is \\boxed{5}.<extra_0>"


def test_split_steps_and_formatting(prm_parts):
    _, tok = prm_parts
    steps = split_steps(STEPS_TEXT)
    assert steps == ["First, 2 + 3 means adding.", "So 2 + 3 = 5.", "The answer is \\boxed{5}."]
    assert split_steps("") == [] == split_steps(" \n\n \n")
    assert split_steps("one line only") == ["one line only"]
    text = format_prm_text(tok, QUESTION, steps)
    assert text.count("<extra_0>") == 3
    assert "Please reason step by step, and put your final answer within \\boxed{}." in text
    assert "First, 2 + 3 means adding.<extra_0>So 2 + 3 = 5.<extra_0>The answer is \\boxed{5}.<extra_0>" in text
    assert text.index(QUESTION) < text.index("First,")


def test_step_rewards_match_a_hand_computation(prm_parts):
    model, tok = prm_parts
    step_id = tok.convert_tokens_to_ids("<extra_0>")
    ids = tok(format_prm_text(tok, QUESTION, split_steps(STEPS_TEXT)), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 2)
    positions = [i for i, t in enumerate(ids) if t == step_id]
    assert len(positions) == 3
    hand = []
    for i in positions:
        l0, l1 = logits[0, i, 0].item(), logits[0, i, 1].item()
        hand.append(math.exp(l1) / (math.exp(l0) + math.exp(l1)))
    got = step_rewards(logits, ids, step_id)
    assert got.tolist() == pytest.approx(hand, rel=1e-5)
    assert step_rewards(logits[0], torch.tensor(ids), step_id).tolist() == pytest.approx(hand, rel=1e-5)
    assert max(hand) - min(hand) > 1e-3  # the check is not vacuous

    v = PRMVerifier(model=model, tokenizer=tok, aggregate="min")
    assert v.step_scores(QUESTION, STEPS_TEXT) == pytest.approx(hand, rel=1e-5)
    assert v.score(QUESTION, [Candidate(STEPS_TEXT), Candidate(""), Candidate("\n\n")]) == [
        pytest.approx(min(hand), rel=1e-5),
        EMPTY_SCORE,
        EMPTY_SCORE,
    ]


def test_step_rewards_reject_a_non_binary_head():
    with pytest.raises(ConfigError, match="2-class"):
        step_rewards(torch.zeros(1, 4, 3), [1, 2, 3, 4], 2)


def test_aggregation():
    r = [0.9, 0.2, 0.6]
    assert aggregate_rewards(r, "min") == pytest.approx(0.2)
    assert aggregate_rewards(r, "last") == pytest.approx(0.6)
    assert aggregate_rewards(r, "product") == pytest.approx(0.9 * 0.2 * 0.6)
    assert aggregate_rewards(torch.tensor(r), "mean") == pytest.approx(1.7 / 3)
    assert aggregate_rewards([], "min") == EMPTY_SCORE
    with pytest.raises(ConfigError):
        aggregate_rewards(r, "max")  # type: ignore[arg-type]


def test_prm_truncates_to_its_context(prm_parts):
    model, tok = prm_parts
    full = PRMVerifier(model=model, tokenizer=tok).step_scores(QUESTION, STEPS_TEXT)
    ids = tok(format_prm_text(tok, QUESTION, split_steps(STEPS_TEXT)), add_special_tokens=False)["input_ids"]
    step_id = tok.convert_tokens_to_ids("<extra_0>")
    second = [i for i, t in enumerate(ids) if t == step_id][1]
    cut = PRMVerifier(model=model, tokenizer=tok, max_length=second + 1).step_scores(QUESTION, STEPS_TEXT)
    assert cut == pytest.approx(full[:2], rel=1e-5)  # causal: the steps that fit score as before
    none = PRMVerifier(model=model, tokenizer=tok, max_length=5)
    assert none.score(QUESTION, [Candidate(STEPS_TEXT)]) == [EMPTY_SCORE]


def test_prm_loads_lazily_from_config(prm_parts, tmp_path):
    model, tok = prm_parts
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = ELMConfig.load(
        overrides={
            "verifier": {"name": "prm", "model": str(tmp_path), "aggregate": "product"},
            "model": {"device": "cpu", "dtype": "float32"},
        }
    )
    v = build_verifier(cfg, None)
    assert isinstance(v, PRMVerifier) and not v.loaded and not v.trust_remote_code
    assert v.score(QUESTION, [Candidate("")]) == [EMPTY_SCORE] and not v.loaded  # no steps, no load
    [s] = v.score(QUESTION, [Candidate(STEPS_TEXT)])
    assert v.loaded
    ref = PRMVerifier(model=model, tokenizer=tok).step_scores(QUESTION, STEPS_TEXT)
    assert s == pytest.approx(math.prod(ref), rel=1e-5)


def test_prm_tokenizer_without_step_token_is_a_config_error(prm_parts, tiny_loaded):
    from transformers import AutoTokenizer

    model, _ = prm_parts
    plain_tok = AutoTokenizer.from_pretrained(tiny_loaded.info.path)
    with pytest.raises(ConfigError, match="step token"):
        PRMVerifier(model=model, tokenizer=plain_tok).score(QUESTION, [Candidate(STEPS_TEXT)])


# ---- consistency ---------------------------------------------------------------------


class FixedSamplesBackend:
    """generate() returns the same fixed sample texts for every prompt and records each call."""

    name = "fixed"

    def __init__(self, texts, tokenizer=None, max_context=4096):
        self.texts = list(texts)
        self.tokenizer = tokenizer
        self.info = types.SimpleNamespace(max_context=max_context)
        self.calls = []

    def generate(self, prompts, params):
        from elm_memory.backends.base import Generation

        self.calls.append((list(prompts), params))
        # one row per sample (n = 1, each its own seed): row j gets the j-th text
        assert params.n == 1 and len(prompts) == len(self.texts)
        return [[Generation(t, [], "answer")] for t in self.texts]


def test_consistency_scores_the_share_of_samples_that_agree():
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["so \\boxed{7}"] * 3 + ["\\boxed{5}"])
    soft = torch.zeros(2, 8)
    memory_prompt = PromptInput((1, 2, 3), soft_prompt=soft, soft_prompt_at=0)
    cands = [
        Candidate("The answer is \\boxed{7}.", (9,), memory_prompt, kind="memory"),
        Candidate("\\boxed{5}", (9,), PromptInput((1, 2, 3))),
        Candidate("\\boxed{7.0}"),  # equivalent to 7
        Candidate("no box at all"),
        Candidate(""),
    ]
    v = ConsistencyVerifier(backend, samples=4, max_new_tokens=64, temperature=0.7, seed=3)
    assert isinstance(v, Verifier) and v.name == "consistency"
    assert v.score(QUESTION, cands) == [0.75, 0.25, 0.75, 0.0, 0.0]
    [(prompts, params)] = backend.calls  # one batched call for all candidates
    # one row per sample, each the zero-shot prompt (soft prompt dropped) with its own seed
    assert len(prompts) == 4 and all(p.token_ids == (1, 2, 3) and p.soft_prompt is None for p in prompts)
    assert [p.seed for p in prompts] == v.sample_seeds(QUESTION) and len({p.seed for p in prompts}) == 4
    assert (params.n, params.temperature, params.seed, params.max_new_tokens) == (1, 0.7, 3, 64)
    assert params.stop_at_answer


def test_consistency_ties_and_unanswerable_candidates_score_equal():
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["\\boxed{1}", "\\boxed{2}", "cut off \\boxed{", "\\boxed{2}"])
    v = ConsistencyVerifier(backend, samples=4)
    zero, memory = v.score(QUESTION, [Candidate("\\boxed{3}", prompt=PromptInput((1,))), Candidate("\\boxed{4}")])
    assert zero == memory == 0.0  # the graph's strict ">" keeps zero-shot
    assert v.score(QUESTION, [Candidate("\\boxed{1}", prompt=PromptInput((1,))), Candidate("\\boxed{2}")]) == [
        0.25,
        0.5,
    ]
    calls = len(backend.calls)
    assert v.score(QUESTION, [Candidate("none"), Candidate("")]) == [0.0, 0.0]
    assert len(backend.calls) == calls  # nothing to agree with: no sampling


class SeededSamplesBackend(FixedSamplesBackend):
    """generate() returns, for each row (n = 1), the text listed for that row's own seed; records each call."""

    def __init__(self, by_seed):
        super().__init__([])
        self.by_seed = by_seed

    def generate(self, prompts, params):
        from elm_memory.backends.base import Generation

        self.calls.append((list(prompts), params))
        assert params.n == 1
        return [[Generation(self.by_seed[p.seed], [], "answer")] for p in prompts]


def test_consistency_tie_draws_more_samples_with_the_next_sample_indices():
    from elm_memory.verifiers.consistency import ConsistencyVerifier
    from elm_memory.verifiers.seeding import sample_seeds

    first_texts = ["\\boxed{1}", "\\boxed{2}", "\\boxed{9}", "cut off"]
    tie_texts = ["\\boxed{2}", "\\boxed{2}", "\\boxed{1}"]
    seeds = sample_seeds(3, QUESTION, 7)  # samples 0-3, then the tie's 4-6
    backend = SeededSamplesBackend(dict(zip(seeds, first_texts + tie_texts, strict=True)))
    prompt = PromptInput((1, 2))
    v = ConsistencyVerifier(backend, samples=4, seed=3, tie_samples=3)
    assert v.score_answers(QUESTION, ["1", "2"], [Candidate("x", prompt=prompt)]) == [2 / 7, 3 / 7]
    [(first_rows, first), (tie_rows, tie)] = backend.calls
    assert [p.seed for p in first_rows] == seeds[:4] and [p.seed for p in tie_rows] == seeds[4:]
    assert tie_rows[0].token_ids == (1, 2) and first.n == tie.n == 1
    assert (tie.temperature, tie.max_new_tokens) == (first.temperature, first.max_new_tokens)
    backend.calls.clear()  # no tie: no second call
    assert v.score_answers(QUESTION, ["9", "5"], [Candidate("x", prompt=prompt)]) == [0.25, 0.0]
    assert len(backend.calls) == 1
    backend.calls.clear()  # samples drawn ahead (the graph's presample) and no tie: nothing drawn at all
    ahead = ["1", "1", "9", "2"]
    assert v.samples_to_score(QUESTION, ["1", "9"], ahead) == ahead and backend.calls == []
    assert v.score_with_samples(["1", "9"], ahead) == [0.5, 0.25]
    # drawn ahead and tied: the tie's 3 follow the 4, in that order (the count is the verifier's cost)
    tied = v.samples_to_score(QUESTION, ["1", "2"], ["1", "2", "5", "5"], [Candidate("x", prompt=prompt)])
    assert tied == ["1", "2", "5", "5", "2", "2", "1"] and len(backend.calls) == 1
    backend.calls.clear()  # nothing answered: nothing to agree with, nothing drawn
    assert v.samples_to_score(QUESTION, [None, None], None) == [] and backend.calls == []
    # a 0-0 tie of answered candidates is a tie; an unanswered candidate ties with nobody
    assert v.is_tie(["5", "6"], [0.0, 0.0]) and not v.is_tie(["5", None], [0.0, 0.0])
    assert not v.is_tie(["5", "6"], [0.5, 0.25]) and v.is_tie(["5", "6", "7"], [0.5, 0.0, 0.5])
    # tie samples off: the tie is kept, nothing more drawn
    off = ConsistencyVerifier(backend, samples=4, seed=3)
    assert off.score_answers(QUESTION, ["1", "2"], [Candidate("x", prompt=prompt)]) == [0.25, 0.25]
    assert len(backend.calls) == 1
    with pytest.raises(ConfigError, match="consistency_tie_samples"):
        ConsistencyVerifier(backend, tie_samples=-1)
    assert ELMConfig.load(overrides={"verifier": {"consistency_tie_samples": 8}}).verifier.consistency_tie_samples == 8


def test_consistency_scores_recorded_answers_like_responses():
    """score_answers (a run's recorded final answers) gives what score gives for the responses."""
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["\\boxed{7}"] * 3 + ["\\boxed{5}"])
    v = ConsistencyVerifier(backend, samples=4)
    prompt = PromptInput((4, 5))
    assert v.score_answers(QUESTION, ["7.0", "5", None], [Candidate("x", prompt=prompt)]) == [0.75, 0.25, 0.0]
    assert backend.calls[-1][0][0].token_ids == (4, 5)  # sampled from the responses' prompt
    calls = len(backend.calls)
    assert v.score_answers(QUESTION, [None, None]) == [0.0, 0.0]
    assert len(backend.calls) == calls


def test_consistency_samples_drawn_ahead_score_as_samples_drawn_on_demand():
    """sample_request is the very call score makes, and score_with_samples on its answers gives the same
    scores: what the graph does when it draws the samples with the candidates (presample)."""
    from elm_memory.verifiers.base import SamplingVerifier
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["\\boxed{7}"] * 3 + ["\\boxed{5}"])
    v = ConsistencyVerifier(backend, samples=4, seed=9, presample=True)
    assert isinstance(v, SamplingVerifier) and v.presample
    soft = torch.zeros(2, 8)
    prompts, params = v.sample_request(QUESTION, PromptInput((1, 2), soft_prompt=soft, soft_prompt_at=0))
    assert prompts[0].token_ids == (1, 2) and prompts[0].soft_prompt is None  # zero-shot: the memory dropped
    on_demand = v.score(QUESTION, [Candidate("\\boxed{5}", prompt=PromptInput((1, 2))), Candidate("\\boxed{7}")])
    [(drawn_prompts, drawn_params)] = backend.calls
    assert drawn_params == params and drawn_prompts == prompts  # the same rows, the same seeds
    gens = [g for row in backend.generate(prompts, params) for g in row]
    assert v.score_with_samples(["5", "7"], v.sample_answers_of(gens)) == on_demand == [0.25, 0.75]
    assert v.score_with_samples(["7", None], []) == [0.0, 0.0]  # no samples: nobody agrees
    assert ConsistencyVerifier(backend).presample and not ConsistencyVerifier(backend, presample=False).presample
    assert ELMConfig.load(overrides={"verifier": {"name": "consistency"}}).verifier.consistency_presample


def test_consistency_budget_fits_the_context_and_prompt_is_built_without_one(tiny_loaded):
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["\\boxed{5}"] * 2, tokenizer=tiny_loaded.tokenizer, max_context=100)
    v = ConsistencyVerifier(backend, samples=2, max_new_tokens=512)
    assert v.score(QUESTION, [Candidate("\\boxed{5}"), Candidate("\\boxed{6}")]) == [1.0, 0.0]
    [(prompts, params)] = backend.calls
    built = PromptBuilder(tiny_loaded.tokenizer).build(QUESTION).token_ids
    assert prompts[0].token_ids == tuple(built) and prompts[0].soft_prompt is None
    assert params.max_new_tokens == 100 - len(built)


def test_consistency_from_config_and_bad_settings():
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    backend = FixedSamplesBackend(["\\boxed{5}"] * 3)
    cfg = ELMConfig.load(
        overrides={
            "verifier": {
                "name": "consistency",
                "consistency_samples": 3,
                "consistency_max_new_tokens": 32,
                "consistency_temperature": 1.0,
            },
            "training": {"seed": 11},
        }
    )
    v = build_verifier(cfg, backend)
    assert isinstance(v, ConsistencyVerifier)
    assert (v.samples, v.max_new_tokens, v.temperature, v.seed) == (3, 32, 1.0, 11)
    defaults = ELMConfig.load().verifier
    assert (defaults.consistency_samples, defaults.consistency_max_new_tokens, defaults.consistency_temperature) == (
        4,
        512,
        0.7,
    )
    for bad in ({"consistency_temperature": 0.0}, {"consistency_samples": 0}, {"consistency_max_new_tokens": 0}):
        with pytest.raises(ConfigError, match="consistency_"):
            ELMConfig.load(overrides={"verifier": bad})
    with pytest.raises(ConfigError, match="consistency_temperature"):
        ConsistencyVerifier(backend, temperature=float("nan"))
    with pytest.raises(BackendError, match="consistency"):
        build_verifier(cfg, None)


def test_consistency_on_the_real_backend(tiny_backend):
    """Real sampling end to end: n seeded samples in one call, reproducible."""
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    v = ConsistencyVerifier(tiny_backend, samples=2, max_new_tokens=8, seed=0)
    first = v.sample_answers(QUESTION)
    assert len(first) == 2 and v.sample_answers(QUESTION) == first
    [s] = v.score(QUESTION, [Candidate("\\boxed{5}")])
    assert s in (0.0, 0.5, 1.0)
