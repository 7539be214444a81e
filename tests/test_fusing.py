"""Answering and learning side by side: per-prompt decode options, ``generate_many`` and FusedCalls."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from elm_memory.backends import decode
from elm_memory.backends.base import Generation, PromptInput, SamplingParams
from elm_memory.backends.fusing import FusedCalls
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import load_problems
from elm_memory.eval.cache import GreedyCache
from elm_memory.eval.records import RecordLog

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.8, n=3, seed=7)


def _ids(result):
    return [[g.token_ids for g in gens] for gens in result]


def _prompts(backend):
    tok = backend.tokenizer
    a = tuple(tok("Tom has 3 apples and buys 4 more. How many", add_special_tokens=False)["input_ids"])
    b = tuple(tok("What is 17 + 25? The answer is", add_special_tokens=False)["input_ids"])
    c = tuple(tok("A train travels 60 km in", add_special_tokens=False)["input_ids"])
    hidden = backend.model.get_input_embeddings().weight.shape[1]
    soft = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0))
    return a, b, PromptInput(c, soft_prompt=soft * 0.01, soft_prompt_at=1)


# ---- the decode loop and the backend ---------------------------------------------------------


def test_generate_many_gives_each_call_what_it_gets_alone(tiny_backend):
    """One greedy call of two prompts and one sampled call (n=3, a soft prompt, another length) decoded as
    one batch: every row equals the row of its own call (float32), and each keeps its own length."""
    a, b, c = _prompts(tiny_backend)
    alone = [tiny_backend.generate([a, b], GREEDY), tiny_backend.generate([c], SAMPLED)]
    calls = []
    real = decode.sample

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "sample", spy)
        together = tiny_backend.generate_many([([a, b], GREEDY), ([c], SAMPLED)])
    assert len(calls) == 1 and [o.n for o in calls[0]] == [1, 1, 3]  # one decode, per-prompt options
    assert [_ids(r) for r in together] == [_ids(r) for r in alone]
    assert all(len(g.token_ids) <= 6 for g in together[1][0]) and len(together[1][0]) == 3
    assert max(len(g.token_ids) for g in together[0][0] + together[0][1]) > 6  # the greedy rows went on


def test_generate_many_stops_at_the_answer_only_for_calls_that_ask(tiny_backend):
    a, b, _ = _prompts(tiny_backend)
    stop = SamplingParams(max_new_tokens=10, stop_at_answer=True)
    alone = [tiny_backend.generate([a], stop), tiny_backend.generate([b], GREEDY)]
    together = tiny_backend.generate_many([([a], stop), ([b], GREEDY)])
    assert [_ids(r) for r in together] == [_ids(r) for r in alone]
    assert [r[0][0].finish_reason for r in together] == [r[0][0].finish_reason for r in alone]


def test_generate_many_runs_calls_alone_when_they_cannot_share_a_batch(tiny_backend):
    a, b, _ = _prompts(tiny_backend)
    calls = []
    real = decode.sample

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with_logprobs = SamplingParams(max_new_tokens=4, logprobs=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "sample", spy)
        out = tiny_backend.generate_many([([a], with_logprobs), ([b], GREEDY)])
    assert len(calls) == 2  # logprobs are computed per call: no shared batch
    assert out[0][0][0].logprobs is not None and len(out[0][0][0].logprobs) == len(out[0][0][0].token_ids)
    assert _ids(out[1]) == _ids(tiny_backend.generate([b], GREEDY))


def test_per_prompt_options_must_match_the_prompts(tiny_loaded):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="2 decode options for 1 prompts"):
        decode.sample(
            tiny_loaded.model,
            torch.ones_like(ids),
            [decode.DecodeOptions(max_new_tokens=2)] * 2,
            input_ids=ids,
        )


def test_the_greedy_cache_serves_hits_and_sends_the_rest_as_one_batch(tiny_backend):
    a, b, c = _prompts(tiny_backend)
    cache = GreedyCache(tiny_backend)
    first = cache.generate([a], GREEDY)
    seen = []
    real = tiny_backend.generate_many

    def spy(requests):
        seen.append([len(p) for p, _ in requests])
        return real(requests)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_backend, "generate_many", spy)
        out = cache.generate_many([([a, b], GREEDY), ([c], SAMPLED)])
    assert seen == [[1, 1]]  # a was a hit; b and the sampled call share one batch
    assert _ids(out[0])[0] == _ids(first)[0] and cache.hits == 1
    assert _ids(out[0])[1] == _ids(tiny_backend.generate([b], GREEDY))[0]


# ---- FusedCalls ---------------------------------------------------------------------------------


class FakeBackend:
    """generate / generate_many that record what they were given; a generation's text names its prompt."""

    name = "fake"

    def __init__(self, many: bool = True, fail: bool = False):
        self.log: list[tuple[str, list]] = []
        self.fail = fail
        self.batches_calls = many
        if not many:
            self.generate_many = None

    def generate(self, prompts, params):
        self.log.append(("generate", [list(prompts)]))
        return [[Generation(f"{p}/{params.n}", [], "stop")] for p in prompts]

    def generate_many(self, requests):
        self.log.append(("many", [list(p) for p, _ in requests]))
        if self.fail:
            raise RuntimeError("decode failed")
        return [[[Generation(f"{p}/{params.n}", [], "stop")] for p in prompts] for prompts, params in requests]


def test_parts_generate_calls_share_one_batch_and_get_their_own_results():
    backend = FakeBackend()
    fused = FusedCalls(backend)

    def answer():
        return fused.backend.generate(["q-zero-shot", "q-memory"], GREEDY)

    def learn():
        first = fused.backend.generate(["q-rollout"], SAMPLED)
        second = fused.backend.generate(["q-step2"], SAMPLED)
        return first, second

    out_answer, (first, second) = fused.run([answer, learn])
    assert [g[0].text for g in out_answer] == ["q-zero-shot/1", "q-memory/1"]
    assert first[0][0].text == "q-rollout/3" and second[0][0].text == "q-step2/3"
    # the answer's call and the first rollouts in one batch (in the parts' order); the second
    # step alone, since the answer had ended
    (kind, calls), last = backend.log
    assert kind == "many" and calls == [["q-zero-shot", "q-memory"], ["q-rollout"]]
    assert last == ("generate", [["q-step2"]])
    assert fused.stats.batches == [2, 1]


@pytest.mark.parametrize("first_to_arrive", [0, 1, 2])
def test_a_batch_holds_its_calls_in_the_parts_order_whatever_order_they_arrived_in(first_to_arrive):
    """Reproducibility: where a row sits in the batch can change what it samples (lookup drafts take the
    latest match among the rows), so the batch follows the parts' order, not the threads' timing."""
    backend = FakeBackend()
    fused = FusedCalls(backend)
    arrived = threading.Event()

    def part(name, i):
        def run():
            if i != first_to_arrive:  # the others call only once the chosen part is waiting in its call
                assert arrived.wait(5)
                time.sleep(0.05)
            else:
                threading.Timer(0.05, arrived.set).start()
            return fused.backend.generate([name], SAMPLED)

        return run

    fused.run([part("learn", 0), part("answer", 1), part("samples", 2)])
    [(kind, calls)] = backend.log
    assert kind == "many" and calls == [["learn"], ["answer"], ["samples"]]


def test_a_parts_generate_many_joins_the_batch_with_all_its_calls():
    """The answer part asks for its answers and a verifier's samples in one generate_many: both calls
    share the batch with the learner's rollouts, and each call gets its own generations back."""
    backend = FakeBackend()
    fused = FusedCalls(backend)

    def answer():
        return fused.backend.generate_many([(["q-zero-shot", "q-memory"], GREEDY), (["q-samples"], SAMPLED)])

    def learn():
        return fused.backend.generate(["q-rollout"], SAMPLED)

    (answers, samples), rollouts = fused.run([answer, learn])
    assert [g[0].text for g in answers] == ["q-zero-shot/1", "q-memory/1"]
    assert samples[0][0].text == "q-samples/3" and rollouts[0][0].text == "q-rollout/3"
    [(kind, calls)] = backend.log
    assert kind == "many" and calls == [["q-zero-shot", "q-memory"], ["q-samples"], ["q-rollout"]]
    assert fused.stats.batches == [3]
    # outside a run, generate_many goes straight to the backend (one call each without generate_many)
    plain = FakeBackend(many=False)
    out = FusedCalls(plain).backend.generate_many([(["a"], GREEDY), (["b"], SAMPLED)])
    assert [r[0][0].text for r in out] == ["a/1", "b/3"] and [e[0] for e in plain.log] == ["generate"] * 2


def test_a_failing_part_leaves_the_batch_and_is_raised_after_the_others_end():
    backend = FakeBackend()
    fused = FusedCalls(backend)
    done = []

    def answer():
        out = fused.backend.generate(["q"], GREEDY)
        done.append(out[0][0].text)

    def learn():
        raise ValueError("bad question")

    with pytest.raises(ValueError, match="bad question"):
        fused.run([answer, learn])
    assert done == ["q/1"] and backend.log == [("generate", [["q"]])]


def test_a_failing_batch_fails_every_call_in_it():
    fused = FusedCalls(FakeBackend(fail=True))
    with pytest.raises(RuntimeError, match="decode failed"):
        fused.run([lambda: fused.backend.generate(["a"], GREEDY), lambda: fused.backend.generate(["b"], SAMPLED)])
    # the next run starts clean
    fused.inner.fail = False
    assert [r[0][0].text for r in fused.run([lambda: fused.backend.generate(["c"], GREEDY)] * 2)] == ["c/1", "c/1"]


def test_without_generate_many_parts_run_in_order_on_the_callers_thread():
    backend = FakeBackend(many=False)
    fused = FusedCalls(backend)
    threads = []

    def part(name):
        def run():
            threads.append(threading.current_thread())
            return fused.backend.generate([name], GREEDY)[0][0].text

        return run

    assert fused.run([part("a"), part("b")]) == ["a/1", "b/1"]
    assert threads == [threading.current_thread()] * 2 and fused.stats.batches == []
    assert [entry[1] for entry in backend.log] == [[["a"]], [["b"]]]


def test_outside_a_run_the_view_is_the_backend():
    backend = FakeBackend()
    fused = FusedCalls(backend)
    assert fused.backend.generate(["x"], GREEDY)[0][0].text == "x/1" and backend.log == [("generate", [["x"]])]
    assert fused.backend.name == "fake"  # other attributes are the backend's


# ---- the online protocol ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "verifier", [pytest.param("self_certainty", marks=(pytest.mark.slow, pytest.mark.extended)), "consistency"]
)
def test_overlapping_answering_and_learning_changes_no_answer_and_no_memory(
    verifier, tiny_loaded, tiny_backend, tmp_path
):
    """The same stream with learner.overlap_answering on and off (float32): the same records and the
    same stored memories, and with it on the answers' decodes really shared batches with rollouts."""
    from elm_memory.elm import ELM
    from elm_memory.eval.methods.base import EvalRuntime, build_method, memory_store_config
    from elm_memory.eval.online import run_stream

    problems = load_problems("gsm8k", limit=3, seed=17)
    runs = {}
    for overlap in (False, True):
        cfg = ELMConfig.load(
            preset="cpu-tiny",
            overrides={
                "generation": {"max_new_tokens": 12},
                "learner": {"overlap_answering": overlap},
                "verifier": {"name": verifier, "consistency_max_new_tokens": 12},
            },
        )
        out = tmp_path / f"overlap-{overlap}"
        runtime = EvalRuntime(cfg, out, loaded=tiny_loaded, backend=tiny_backend)
        if overlap:  # count the shared batches through the method the run builds
            built = []
            real = build_method

            def spy(name, rt, real=real, built=built):
                built.append(real(name, rt))
                return built[-1]

            mp = pytest.MonkeyPatch()
            mp.setattr("elm_memory.eval.online.build_method", spy)
        try:
            run_stream(problems, ["elm_input"], cfg, out, dataset="gsm8k", seed=17, runtime=runtime, progress=False)
        finally:
            if overlap:
                mp.undo()
        records = RecordLog(out / "records.jsonl").read()
        store_cfg = memory_store_config(cfg, out, "elm_input").model_copy(update={"namespace": "elm_input"})
        with ELM(store_cfg, loaded=tiny_loaded, backend=tiny_backend) as elm:
            store = elm.retriever.store
            memories = {r.id: store.load(r).soft_prompt for r in store.list("elm_input")}
        keep = ("answer", "route", "memory_id", "candidates", "response", "pool_size")
        runs[overlap] = ([{k: r[k] for k in keep} for r in records], memories)
    assert runs[True][0] == runs[False][0]
    assert sorted(runs[True][1]) == sorted(runs[False][1]) and len(runs[True][1]) == 3
    for mid, soft in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][mid], soft)
    [method] = built
    assert method.overlap and method.fused.stats.batches.count(2) >= 3  # each question: answer + rollouts


def test_batches_decode_in_the_calling_thread_and_the_first_part_runs_there():
    caller = threading.current_thread()
    seen = []

    class Recording(FakeBackend):
        def generate_many(self, requests):
            seen.append(threading.current_thread())
            return super().generate_many(requests)

        def generate(self, prompts, params):
            seen.append(threading.current_thread())
            return super().generate(prompts, params)

    fused = FusedCalls(Recording())
    first_thread = []

    def first():
        first_thread.append(threading.current_thread())
        return "no generate"

    def second():  # waits in generate after the first part has ended: the caller decodes it
        return fused.backend.generate(["late"], GREEDY)[0][0].text

    assert fused.run([first, second]) == ["no generate", "late/1"]
    assert fused.run([second, second]) == ["late/1", "late/1"]
    assert first_thread == [caller] and seen and all(t is caller for t in seen)


def test_a_cache_in_front_of_a_backend_that_cannot_batch_runs_the_parts_in_order():
    """The evaluation's greedy cache has generate_many of its own, but only the backend behind it can
    batch: in front of one that cannot (e.g. vLLM), nothing runs in another thread."""

    class Plain:
        name = "plain"
        tokenizer = None

        def generate(self, prompts, params):
            return [[Generation("x", [], "stop")] for _ in prompts]

    assert not FusedCalls(GreedyCache(Plain())).can_fuse
    assert FusedCalls(GreedyCache(FakeBackend())).can_fuse and not FusedCalls(FakeBackend(many=False)).can_fuse


@pytest.mark.parametrize("where", ["after_its_call", "in_its_call"])
def test_an_interrupt_in_the_calling_thread_ends_every_part_at_once(where):
    """Ctrl-C reaches the caller's thread only. Whether it lands in the first part's own work or in a batch
    the caller decodes, the other part's next generate raises instead of decoding on (it would decode
    1000 more batches otherwise), the run raises KeyboardInterrupt, and the next run starts clean."""
    backend = FakeBackend()
    fused = FusedCalls(backend)
    answered = []

    def learn():  # the caller's part
        if where == "in_its_call":
            backend.generate_many = _interrupt
        fused.backend.generate(["q-rollout"], SAMPLED)
        raise KeyboardInterrupt

    def answer():
        for i in range(1000):
            answered.append(fused.backend.generate([f"q-token{i}"], GREEDY))

    with pytest.raises(KeyboardInterrupt):
        fused.run([learn, answer])
    assert len(answered) <= 1
    backend.generate_many = FakeBackend.generate_many.__get__(backend)
    assert [r[0][0].text for r in fused.run([lambda: fused.backend.generate(["c"], GREEDY)] * 2)] == ["c/1", "c/1"]


def _interrupt(requests):
    raise KeyboardInterrupt


def _moved_lora(model, seed):
    """A LoRA well away from the base model (B drawn, not zero), so a delta on the wrong rows would show."""
    from elm_memory.memory.lora import LoraAdapter

    lora = LoraAdapter.initial(model, rank=2, alpha=4.0, seed=seed)
    with torch.no_grad():
        for _, b in lora.weights.values():
            b.normal_(0, 0.5)
    return lora


@contextlib.contextmanager
def _decodes():
    """The memory each decode.sample call applied, in order."""
    memories = []
    real = decode.sample

    def spy(*args, **kwargs):
        memories.append(kwargs.get("memory"))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "sample", spy)
        yield memories


def test_generate_many_decodes_rows_of_different_lora_memories_and_none_as_one_batch(tiny_backend, tiny_loaded):
    """A stream memory's rows beside the base model's (and another LoRA's) in one decode: each LoRA reaches its
    own rows only, through the samples' repetition and the finished rows dropped; every row equals the row of
    its own call (float32)."""
    from elm_memory.memory.lora import RowLoras

    one, two = _moved_lora(tiny_loaded.model, 3), _moved_lora(tiny_loaded.model, 4)
    a, b, c = _prompts(tiny_backend)
    requests = [
        ([a], GREEDY),
        ([PromptInput(a, memory=one)], GREEDY),
        ([PromptInput(b, memory=two), b], GREEDY),
        ([c], SAMPLED),
        ([PromptInput(b, memory=one)], SAMPLED),
    ]
    alone = [tiny_backend.generate(prompts, params) for prompts, params in requests]
    with _decodes() as calls:
        together = tiny_backend.generate_many(requests)
    assert len(calls) == 1 and isinstance(calls[0], RowLoras)  # one decode for all five calls
    assert [_ids(r) for r in together] == [_ids(r) for r in alone]
    assert _ids(together[0]) != _ids(together[1])  # the adapter changed its rows
    assert _ids(together[2])[1] == _ids(tiny_backend.generate([b], GREEDY))[0]


def test_one_generate_call_with_a_lora_prompt_and_plain_prompts_decodes_one_batch(tiny_backend, tiny_loaded):
    """A question's zero-shot row and its LoRA memory's row in one call (the graph's two candidates): one decode,
    each row as it decodes alone."""
    lora = _moved_lora(tiny_loaded.model, 5)
    a, b, _ = _prompts(tiny_backend)
    prompts = [PromptInput(a), PromptInput(a, memory=lora), PromptInput(b)]
    alone = [tiny_backend.generate([p], GREEDY)[0] for p in prompts]
    with _decodes() as calls:
        together = tiny_backend.generate(prompts, GREEDY)
    assert len(calls) == 1
    assert _ids(together) == _ids(alone)
    assert together[0][0].token_ids != together[1][0].token_ids
