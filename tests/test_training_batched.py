"""Many memories at once: ``NativeTrainer.train_many`` equals each memory trained alone, the
per-prompt seeds that make that possible, and the learner draining queued jobs in batches.

The model is a randomly initialised 2-layer Llama (fp32) with SmolLM2's tokenizer: real
sampling, real batched forward/backward, in well under a second per run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from _fakes import one_thread

from elm_memory.backends.base import Generation, PromptInput, SamplingParams
from elm_memory.config import TrainingConfig
from elm_memory.errors import NonFiniteError
from elm_memory.jobs import BackgroundLearner, LearnJob, SyncLearner
from elm_memory.training.native import NativeTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HIDDEN = 32


@pytest.fixture(scope="module")
def rand_loaded():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from elm_memory.models.fingerprint import embedding_fingerprint
    from elm_memory.models.loading import LoadedModel, ModelInfo
    from elm_memory.models.prepare import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model("packaged:smollm2-135m", verbose=False)))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    info = ModelInfo(
        name="random-llama",
        path="",
        model_type="llama",
        hidden_size=HIDDEN,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(tok),
        max_context=512,
        dtype="float32",
        device="cpu",
        fingerprint=embedding_fingerprint(model),
    )
    with one_thread():  # tiny matrices: more threads only add contention on a shared box
        yield LoadedModel(model=model, tokenizer=tok, info=info, load_seconds=0.0)


@pytest.fixture(scope="module")
def rand_backend(rand_loaded):
    from elm_memory.backends.hf import HFBackend

    return HFBackend(rand_loaded)


class ScriptedRewards:
    """The real HF backend's rollouts, with texts rewritten so the majority-vote rewards are
    known: rollout 0 answers 2, rollout 1 answers 1, the others depend on their tokens; a prompt
    listed in ``uniform`` answers 7 everywhere on its n-th call (n counted per prompt, so alone
    and batched runs see the same script). Completions are cut to a token-dependent length so
    the rows of a batch have different lengths."""

    name = "scripted-rewards"

    def __init__(self, real, uniform: dict[tuple[int, ...], int]):
        self.real, self.uniform = real, uniform
        self.tokenizer, self.info = real.tokenizer, real.info
        self.calls: list[list[PromptInput]] = []
        self.seen: dict[tuple[int, ...], int] = {}

    def generate(self, prompts, params: SamplingParams):
        self.calls.append(list(prompts))
        out = []
        for p, gens in zip(prompts, self.real.generate(prompts, params), strict=True):
            call = self.seen.get(p.token_ids, 0)
            self.seen[p.token_ids] = call + 1
            group = []
            for j, g in enumerate(gens):
                ids = g.token_ids[: 1 + sum(g.token_ids) % max(1, len(g.token_ids))]
                answer = 2 if j == 0 else 1 if j == 1 else 1 + sum(ids) % 2
                if self.uniform.get(p.token_ids) == call:
                    answer = 7
                group.append(Generation(text=f"\\boxed{{{answer}}}", token_ids=ids, finish_reason=g.finish_reason))
            out.append(group)
        return out


PROMPTS = [tuple(range(300, 307)), tuple(range(1000, 1015)), tuple(range(5000, 5011))]  # 7, 15, 11 tokens
AT = [0, 3, 11]


def _cfg(**kw) -> TrainingConfig:
    base = dict(
        steps=3,
        num_generations=4,
        max_completion_length=10,
        learning_rate=1e-2,
        beta=0.05,
        max_grad_norm=1e-3,
        seed=123,
    )
    return TrainingConfig(**{**base, **kw})


def _inits() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, HIDDEN, generator=g) * 0.02 for _ in PROMPTS]


def _items():
    return [(list(p), init, at) for p, init, at in zip(PROMPTS, _inits(), AT, strict=True)]


@pytest.mark.parametrize("micro", [None, 5])
def test_m_memories_together_equal_each_memory_alone(rand_loaded, rand_backend, micro, monkeypatch):
    # memory 2 has uniform rewards at step 1, memory 3 at step 0: they skip their own backward only
    uniform = {PROMPTS[1]: 1, PROMPTS[2]: 0}
    cfg = _cfg(micro_batch_size=micro)
    together_backend = ScriptedRewards(rand_backend, uniform)
    steps: dict[int, int] = {}  # optimizer steps per memory (keyed by its soft prompt's identity)
    real_step = torch.optim.AdamW.step

    def counting_step(self, *args, **kwargs):
        key = id(self.param_groups[0]["params"][0])
        steps[key] = steps.get(key, 0) + 1
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    together = NativeTrainer(rand_loaded, together_backend, cfg).train_many(_items(), progress=False)
    monkeypatch.undo()
    assert sorted(steps.values()) == [2, 2, 3]  # a skipped step leaves the memory's optimizer alone
    # one backend call per step, carrying all three prompts with their own seed
    assert [len(c) for c in together_backend.calls] == [3, 3, 3]
    assert all(p.seed == 123 + step for step, c in enumerate(together_backend.calls) for p in c)

    for item, batched in zip(_items(), together, strict=True):
        lone = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, uniform), cfg)
        [alone] = lone.train_many([item], progress=False)
        assert (batched.soft_prompt - alone.soft_prompt).abs().max().item() < 1e-5
        assert (alone.soft_prompt - item[1]).abs().max().item() > 1e-3  # it really trained
        a, b = alone.stats, batched.stats
        assert b.answers == a.answers and b.mean_reward == a.mean_reward
        assert b.skipped_backward == a.skipped_backward and b.completion_tokens == a.completion_tokens
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-9) and b.kl == pytest.approx(a.kl, rel=1e-4, abs=1e-12)
    assert [r.stats.skipped_backward for r in together] == [[False] * 3, [False, True, False], [True, False, False]]


def test_unset_micro_batch_backs_up_one_rollout_at_a_time_on_a_cpu(rand_loaded, rand_backend, monkeypatch):
    """On a CPU the group's backward takes one rollout per forward (activation memory) and learns what
    the whole group in one forward learns; ``micro_batch_size`` set by hand still wins."""
    from elm_memory.training import native

    rows_with_grad: list[int] = []
    real = native.completion_logprobs

    def spy(model, prompts, completions, **kw):
        if torch.is_grad_enabled():
            rows_with_grad.append(len(completions))
        return real(model, prompts, completions, **kw)

    monkeypatch.setattr(native, "completion_logprobs", spy)
    prompt, init, at = _items()[0]

    def trained(**kw):
        rows_with_grad.clear()
        trainer = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, {}), _cfg(steps=2, **kw))
        return trainer.train(prompt, init, at=at, progress=False).soft_prompt

    unset = trained()
    assert rows_with_grad == [1] * 8  # 2 steps x G=4 rollouts, one per forward
    whole = trained(micro_batch_size=4)
    assert rows_with_grad == [4, 4]
    assert (unset - init).abs().max().item() > 1e-3  # it trained
    assert (unset - whole).abs().max().item() < 1e-5
    assert native.default_micro_batch(rand_loaded.model, 8) == 1


def test_train_is_train_many_with_one_memory(rand_loaded, rand_backend):
    cfg = _cfg(steps=2)
    prompt, init, at = _items()[1]
    one = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, {}), cfg).train(prompt, init, at=at, progress=False)
    many = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, {}), cfg).train_many([(prompt, init, at)])
    assert torch.equal(one.soft_prompt, many[0].soft_prompt)


def test_batched_logps_equal_lone_logps(rand_loaded, rand_backend):
    """Left-padded prompts with per-row soft prompts score each row as it is scored alone."""
    trainer = NativeTrainer(rand_loaded, rand_backend, _cfg())
    inits = _inits()
    comps = [[11, 12, 13], [40, 41], [7, 8, 9, 10, 11, 12], [99]]
    rows = [0, 1, 2, 1]
    batched, mask = trainer.completion_logps([list(p) for p in PROMPTS], inits, AT, comps, rows=rows)
    for r, (p, c) in enumerate(zip(rows, comps, strict=True)):
        alone, _ = trainer.completion_logps(list(PROMPTS[p]), inits[p], AT[p], [c])
        assert torch.allclose(batched[r, : len(c)], alone[0, : len(c)], atol=1e-5)
        assert mask[r].sum().item() == len(c)


def test_gradients_stay_in_their_own_memory(rand_loaded, rand_backend):
    trainer = NativeTrainer(rand_loaded, rand_backend, _cfg())
    softs = [torch.nn.Parameter(t.clone()) for t in _inits()]
    logps, mask = trainer.completion_logps([list(p) for p in PROMPTS], softs, AT, [[5, 6], [7, 8, 9]], rows=[0, 2])
    (logps[1] * mask[1]).sum().backward()  # only memory 3's row
    assert softs[0].grad is None or softs[0].grad.abs().max().item() == 0.0
    assert softs[1].grad is None  # not in the batch at all
    assert softs[2].grad.abs().max().item() > 0.0


def test_a_nan_in_one_memory_aborts_the_call_and_names_it(rand_loaded, rand_backend, monkeypatch):
    trainer = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, {}), _cfg(steps=1))
    real = trainer.completion_logps

    def poisoned(*args, rows=None, **kwargs):
        logps, mask = real(*args, rows=rows, **kwargs)
        bad = torch.tensor([float("nan") if r == 1 else 1.0 for r in rows])[:, None]
        return logps * bad, mask

    monkeypatch.setattr(trainer, "completion_logps", poisoned)
    with pytest.raises(NonFiniteError, match="memory 2/3: loss is nan"):
        trainer.train_many(_items(), progress=False)


# -- per-prompt seeds in the transformers backend ----------------------------------------------


def test_a_prompt_with_its_own_seed_samples_the_same_alone_or_in_any_batch(rand_backend):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, n=3, seed=5)
    g = torch.Generator().manual_seed(0)
    a = PromptInput(PROMPTS[0], soft_prompt=torch.randn(4, HIDDEN, generator=g), soft_prompt_at=2, seed=5)
    b = PromptInput(PROMPTS[1], soft_prompt=torch.randn(4, HIDDEN, generator=g), seed=5)
    c = PromptInput(PROMPTS[2], seed=9)
    [alone] = rand_backend.generate([a], params)
    batched = rand_backend.generate([b, c, a], params)
    assert [x.token_ids for x in batched[2]] == [x.token_ids for x in alone]
    assert len({tuple(x.token_ids) for x in alone}) == 3  # n distinct samples
    [other_seed] = rand_backend.generate([PromptInput(PROMPTS[0], a.soft_prompt, 2, seed=6)], params)
    assert [x.token_ids for x in other_seed] != [x.token_ids for x in alone]


# -- the learner drains batches ------------------------------------------------------------------


class BatchSpy:
    """learn_fn + learn_many_fn fakes: records the batches, fails the jobs named 'bad'."""

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.batches: list[list[str]] = []
        self.singles: list[str] = []
        self.lock = threading.Lock()

    def one(self, job: LearnJob) -> str:
        if self.gate is not None:
            self.gate.wait(10)
        with self.lock:
            self.singles.append(job.question)
        if "bad" in job.question:
            raise RuntimeError(f"cannot learn {job.question}")
        return job.job_id

    def many(self, jobs: list[LearnJob]) -> list[str]:
        with self.lock:
            self.batches.append([j.question for j in jobs])
        if any("bad" in j.question for j in jobs):
            raise NonFiniteError("loss is nan at step 1; memory aborted")  # whose? the batch cannot tell
        return [j.job_id for j in jobs]


def test_background_learner_drains_queued_jobs_in_one_batch(tmp_path: Path):
    gate = threading.Event()
    spy = BatchSpy(gate)
    with BackgroundLearner(
        spy.one, tmp_path / "q.sqlite3", learn_many_fn=spy.many, batch_size=3, poll_interval=0.05
    ) as learner:
        first = learner.submit("q0")  # claimed alone while nothing else is queued; blocks on the gate
        for _ in range(200):
            if learner.job(first.job_id).state == "running":
                break
            threading.Event().wait(0.01)
        tickets = [learner.submit(q) for q in ("q1", "q2", "q3", "q4")]
        gate.set()
        assert learner.wait(timeout=20)
        assert all(learner.job(t.job_id).state == "done" for t in [first, *tickets])
        assert learner.job(tickets[0].job_id).memory_id == tickets[0].job_id
    assert spy.batches == [["q1", "q2", "q3"]]  # up to batch_size, oldest first
    assert spy.singles == ["q0", "q4"]  # a batch of one is just the one job


def test_one_bad_job_does_not_fail_its_batch(tmp_path: Path):
    from elm_memory.jobs import JobQueue

    spy = BatchSpy()
    path = tmp_path / "q.sqlite3"
    with JobQueue(path) as q:  # queued before any worker runs: the worker's first claim takes all three
        jobs = [LearnJob.create(text, "ns") for text in ("good 1", "bad", "good 2")]
        for job in jobs:
            q.add(job)
    with SyncLearner(spy.one, path, learn_many_fn=spy.many, batch_size=3, max_attempts=1) as learner:
        assert learner.wait(timeout=20)
        states = {j.question: learner.job(j.job_id) for j in jobs}
    assert spy.batches == [["good 1", "bad", "good 2"]]
    assert spy.singles == ["good 1", "bad", "good 2"]  # the batch failed: each job alone identifies the bad one
    assert states["good 1"].state == "done" and states["good 2"].state == "done"
    assert states["bad"].state == "failed" and "cannot learn bad" in states["bad"].error


def test_batch_size_one_is_the_old_one_job_at_a_time(tmp_path: Path):
    spy = BatchSpy()
    with SyncLearner(spy.one, tmp_path / "q.sqlite3", learn_many_fn=spy.many, batch_size=1) as learner:
        for q in ("a", "b"):
            assert learner.submit(q).done
    assert spy.batches == [] and spy.singles == ["a", "b"]


# -- the learn paths: learn_memories and the ELM's learner batch -------------------------------------


def _elm_config(**training):
    from elm_memory.config import ELMConfig

    overrides = {
        "training": {"steps": 2, "num_generations": 4, "max_completion_length": 8, "learning_rate": 1e-2, **training},
        "memory": {"num_tokens": 4},
        "store": {"kind": "none"},
        "learner": {"mode": "off"},
    }
    return ELMConfig.load(preset="cpu-tiny", overrides=overrides)


QUESTIONS = ["What is 2 + 3?", "A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive?"]


def test_learn_memories_equals_learn_memory_per_question(rand_loaded, rand_backend):
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.training.learn import learn_memories, learn_memory

    cfg = _elm_config()
    prompts = PromptBuilder(rand_loaded.tokenizer, cfg.prompt, rand_loaded.info.max_context)
    common = dict(config=cfg, loaded=rand_loaded, prompts=prompts, progress=False)
    together = learn_memories(
        QUESTIONS,
        backend=ScriptedRewards(rand_backend, {}),
        namespace=["a", "b"],
        memory_ids=["aa" * 8, "bb" * 8],
        **common,
    )
    assert [(m.id, m.meta.namespace, m.meta.question) for m in together] == [
        ("aa" * 8, "a", QUESTIONS[0]),
        ("bb" * 8, "b", QUESTIONS[1]),
    ]
    for question, memory in zip(QUESTIONS, together, strict=True):
        alone = learn_memory(question, backend=ScriptedRewards(rand_backend, {}), **common)
        assert (memory.soft_prompt - alone.soft_prompt).abs().max().item() < 1e-5
        assert memory.meta.stats.skipped_backward == alone.meta.stats.skipped_backward == [False, False]


def test_learning_reports_each_step_and_old_engines_still_work(rand_loaded, rand_backend):
    """on_step(done, steps) after each step of the batch; an engine whose train_many predates on_step
    still trains when no one asks for steps."""
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.training.learn import learn_memories

    cfg = _elm_config(steps=3)
    prompts = PromptBuilder(rand_loaded.tokenizer, cfg.prompt, rand_loaded.info.max_context)
    common = dict(config=cfg, loaded=rand_loaded, prompts=prompts, progress=False)
    seen: list[tuple[int, int]] = []
    learn_memories(QUESTIONS, backend=ScriptedRewards(rand_backend, {}), on_step=lambda *s: seen.append(s), **common)
    assert seen == [(1, 3), (2, 3), (3, 3)]

    class OldEngine:  # a plugin written against the protocol before on_step
        engine = "old"

        def __init__(self):
            self.inner = NativeTrainer(rand_loaded, ScriptedRewards(rand_backend, {}), cfg.training, cfg.memory)

        def train_many(self, prompts, *, objective=None, progress=None):
            return self.inner.train_many(prompts, objective=objective, progress=progress)

    [memory] = learn_memories(QUESTIONS[:1], backend=rand_backend, trainer=OldEngine(), **common)
    assert memory.meta.stats.skipped_backward == [False, False, False]


def test_elm_learner_batch_trains_jobs_with_equal_overrides_together(rand_loaded, rand_backend, monkeypatch):
    from elm_memory.elm import ELM

    elm = ELM(_elm_config(), loaded=rand_loaded, backend=ScriptedRewards(rand_backend, {}))
    calls = []
    real = elm.learn_many

    def spy(questions, **kwargs):
        calls.append((list(questions), kwargs["config"].training.steps))
        return real(questions, **kwargs)

    monkeypatch.setattr(elm, "learn_many", spy)
    one_step = {"training": {"steps": 1}}
    jobs = [
        LearnJob.create(QUESTIONS[0], "ns"),
        LearnJob.create("What is 7 * 6?", "ns", config_overrides=one_step),
        LearnJob.create(QUESTIONS[1], "other"),
    ]
    results = elm.learn_from_jobs(jobs)
    assert results == [j.job_id for j in jobs]  # the memory id is the job id
    assert calls == [([QUESTIONS[0], QUESTIONS[1]], 2), (["What is 7 * 6?"], 1)]


def test_shared_prompt_forward_gives_the_same_logps_and_gradients(rand_loaded, rand_backend):
    """training.share_prompt_kv: one prompt forward per memory, KV repeated per rollout, equals G copies."""
    items = _items()
    comps = [[5, 9, 11, 3], [7, 7], [2, 4, 6, 8, 10, 12], [13], [9, 9, 9]]  # right-padded, different lengths
    owner = [0, 1, 0, 2, 1]
    results = []
    for share in (False, True):
        trainer = NativeTrainer(rand_loaded, rand_backend, _cfg(share_prompt_kv=share))
        softs = [init.clone().requires_grad_(True) for _, init, _ in items]
        logps, mask = trainer.completion_logps([i[0] for i in items], softs, [i[2] for i in items], comps, rows=owner)
        (logps * mask).sum().backward()
        results.append((logps.detach(), mask, [s.grad.clone() for s in softs]))
    (lp_a, mask_a, g_a), (lp_b, mask_b, g_b) = results
    assert torch.equal(mask_a, mask_b)
    assert torch.allclose(lp_a * mask_a, lp_b * mask_b, atol=1e-5)
    for a, b in zip(g_a, g_b, strict=True):
        assert a.abs().sum() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
