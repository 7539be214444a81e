"""A stream memory's bounded replay (``stream.tuning.replay``): which kept questions an update learns from again, how
the buffer is bounded, refused with GRPO on stored rows, kept in each version's file through resumes and
rollbacks, and re-sampled under the serving version (``stream.tuning.replay_samples``)."""

from __future__ import annotations

import json

import pytest
import torch
from test_stream_memory import _config, _gens, _poisoned_backward, _prompt

from elm_memory.backends.base import Generation, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import question_hash
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_replay import PooledQuestion, ReplayBuffer, resample, resample_kept
from elm_memory.training.stream_samples import learnable_rows


def _item(question: str, label: str = "5") -> PooledQuestion:
    return PooledQuestion(question, [1, 2, 3], 1, [[4, 5], [6]], torch.ones(2), label, 0.6)


def test_the_buffer_keeps_the_newest_and_a_repeated_question_once():
    buffer = ReplayBuffer(3)
    buffer.add([_item("q1"), _item("q2")])
    buffer.add([_item("q3"), _item("q4")])
    assert [q.question for q in buffer.items] == ["q2", "q3", "q4"]
    buffer.add([_item("q2", label="7")])  # asked again: its new rows replace the old ones
    assert [(q.question, q.label) for q in buffer.items] == [("q3", "5"), ("q4", "5"), ("q2", "7")]
    with pytest.raises(ValueError, match="at least one question"):
        ReplayBuffer(0)


def test_a_draw_is_seeded_and_never_the_updates_own_question():
    buffer = ReplayBuffer(8, [_item(f"q{i}") for i in range(8)])
    first = [q.question for q in buffer.draw(3, seed=11, exclude=[_item("q0")])]
    assert first == [q.question for q in buffer.draw(3, seed=11, exclude=[_item("q0")])]
    assert len(set(first)) == 3 and "q0" not in first
    assert len(buffer.draw(50, seed=1)) == 8 and buffer.draw(0, seed=1) == []
    assert ReplayBuffer(2).draw(2, seed=1) == []
    seen = {q.question for s in range(40) for q in buffer.draw(1, seed=s)}
    assert len(seen) > 4  # uniform over the kept questions, not always the newest


def _stream(buffer: int, samples: int = 0):
    return _config(objective="sft", replay=1, replay_buffer=buffer, replay_samples=samples).stream


def test_the_buffer_round_trips_through_json():
    buffer = ReplayBuffer(4, [_item("q1"), _item("q2", label="9")])
    again = ReplayBuffer.for_config(_stream(4), buffer.to_json())
    assert [q.to_json() for q in again.items] == buffer.to_json()
    assert torch.equal(again.items[1].weights, torch.ones(2)) and again.items[1].label == "9"
    assert len(ReplayBuffer.for_config(_stream(1), buffer.to_json())) == 1
    assert len(ReplayBuffer.for_config(_stream(4))) == 0


def test_a_resampling_buffer_keeps_questions_without_their_rows_so_more_of_them_fit():
    def answered(question):  # four rows of 100 tokens: a question's rows outweigh its prompt, as in a real run
        return PooledQuestion(question, [1, 2, 3], 1, [[7] * 100] * 4, torch.ones(4), "5", 0.6)

    with_rows = ReplayBuffer(10, max_bytes=2 + 3 * (len(json.dumps(answered("q0").to_json())) + 2))
    without = ReplayBuffer(10, keep_rows=False, max_bytes=with_rows.max_bytes)
    for buffer in (with_rows, without):
        buffer.add([answered(f"q{i}") for i in range(5)])
    assert len(with_rows) == 3 and len(without) == 5  # the same bytes hold every question once rows are gone
    assert all(q.completions == [] and q.weights.numel() == 0 for q in without.items)
    assert [q.prompt_ids for q in without.items] == [[1, 2, 3]] * 5 and without.items[0].label == "5"
    assert len(without.draw(5, seed=1)) == 5  # re-sampling draws fresh rows: rows-less questions are drawn
    # a version written with re-sampling on, resumed with it off: its rows-less questions cannot be learned again
    resumed = ReplayBuffer.for_config(_stream(10), without.to_json() + [answered("q9").to_json()])
    assert resumed.keep_rows and len(resumed) == 6
    assert [q.question for q in resumed.draw(5, seed=1)] == ["q9"]
    # and the other way round: rows kept by a run without re-sampling are dropped when it turns on
    assert ReplayBuffer.for_config(_stream(10, samples=2), with_rows.to_json()).items[0].completions == []


def test_replay_with_a_policy_gradient_is_refused_at_load():
    with pytest.raises(
        ConfigError,
        match="stream.tuning.replay=2 with stream.tuning.replay_samples=0: .* or stream.tuning.objective=sft",
    ):
        ELMConfig.load(preset="cpu-tiny", overrides={"stream": {"tuning": {"replay": 2, "objective": "grpo"}}})
    assert (
        ELMConfig.load(
            preset="cpu-tiny", overrides={"stream": {"tuning": {"replay": 2, "objective": "sft"}}}
        ).stream.tuning.replay
        == 2
    )


def test_an_update_learns_again_from_kept_questions_and_the_version_file_keeps_them(smol, tmp_path):
    cfg = _config(objective="sft", replay=1, replay_buffer=2, guard_window=1000)
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    first = stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert first.applied and "replayed" not in stream.history[-1]  # nothing kept yet
    second = stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5")
    assert second.applied and stream.history[-1]["replayed"] == [question_hash("q1")]
    stream.learn("q3", ids, at, gens, label="5", version_used=2, zero_shot_answer="5")
    kept = LatentMemory.load(stream.files.path(3)).meta.config["stream"]["replay"]
    assert [q["question"] for q in kept] == ["q2", "q3"]  # bounded to replay_buffer, the newest
    # a new process continues with the buffer of the version it serves
    again = StreamMemory(cfg, smol, tmp_path, namespace="ns")
    assert [q.question for q in again.replay.items] == ["q2", "q3"]
    # going back to version 1 brings back version 1's buffer: what versions 2 and 3 kept is gone with them
    again.restore_version(1, reason="by hand")
    assert [q.question for q in again.replay.items] == ["q1"]
    assert torch.equal(again.replay.items[0].weights, torch.ones(3))  # the three rows that agreed with "5"


def test_without_replay_the_version_files_hold_no_buffer(smol, tmp_path):
    stream = StreamMemory(_config(objective="sft", guard_window=1000), smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)
    assert stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5").applied
    assert "replay" not in LatentMemory.load(stream.files.path(1)).meta.config["stream"]
    assert "replayed" not in stream.history[-1]


def test_the_buffer_stays_within_its_byte_budget_dropping_the_oldest():
    one = len(json.dumps(_item("q0").to_json())) + 2
    buffer = ReplayBuffer(10, max_bytes=2 + 3 * one)
    buffer.add([_item(f"q{i}") for i in range(5)])
    assert [q.question for q in buffer.items] == ["q2", "q3", "q4"]  # capacity 10, but three fit
    assert len(json.dumps(buffer.to_json())) <= buffer.max_bytes


def test_a_non_finite_update_leaves_the_buffer_as_it_was(smol, tmp_path, monkeypatch):
    cfg = _config(objective="sft", replay=1, guard_window=1000)
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 3 + ["\\boxed{6}"] * 2)
    assert stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5").applied
    monkeypatch.setattr(StreamMemory, "_backward", _poisoned_backward)
    update = stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5")
    assert update.skipped == "non_finite" and [q.question for q in stream.replay.items] == ["q1"]


# -- re-sampling (stream.tuning.replay_samples) ------------------------------------------------------------------
class _ScriptedBackend:
    """Answers the i-th row of each call with ``texts[i % len(texts)]``, and keeps the rows and params it got."""

    def __init__(self, texts, tokenizer=None):
        self.texts, self.tokenizer, self.calls = texts, tokenizer, []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), params))
        out = []
        for i, _ in enumerate(prompts):
            text = self.texts[i % len(self.texts)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if self.tokenizer else [100 + i]
            out.append([Generation(text, ids, "stop")])
        return out


def test_resampling_keeps_the_rows_that_agree_with_the_kept_label_and_drops_a_question_with_none():
    backend = _ScriptedBackend(["\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}", "\\boxed{8}", "\\boxed{9}"])
    items = [_item("q1", label="5"), _item("q2", label="4")]

    def run(objective):
        return resample(
            items,
            serve=lambda rows, at: list(rows),
            backend=backend,
            params=SamplingParams(temperature=0.7),
            n=3,
            seed=7,
            objective=objective,
        )

    kept, notes = run("sft")
    assert [q.question for q in kept] == ["q1"]  # no sample of q2 says 4
    assert kept[0].completions == [[100], [102]] and torch.equal(kept[0].weights, torch.ones(2))
    assert kept[0].label == "5" and kept[0].share == pytest.approx(2 / 3)
    assert notes == [
        {"question_hash": question_hash("q1"), "agreeing": 2, "of": 3},
        {"question_hash": question_hash("q2"), "agreeing": 0, "of": 3},
    ]
    assert items[0].completions == [[4, 5], [6]]  # the kept question itself is not changed
    rows, params = backend.calls[0]
    seeds = [r.seed for r in rows]
    assert len(rows) == 6 and len(set(seeds)) == 6 and params.n == 1  # one call, every row its own seed
    kept, _ = run("grpo")
    assert [q.question for q in kept] == ["q1"]  # q2's rewards are uniform: no gradient
    assert kept[0].completions == [[100], [101], [102]]
    assert torch.allclose(kept[0].weights, torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    assert [r.seed for r in backend.calls[-1][0]] == seeds  # the same seed draws the same rows


def test_an_update_resamples_with_its_config_and_one_serving_copy_and_a_copy_that_fails_costs_the_replay():
    cfg = _config(objective="sft", replay=2, replay_samples=2)
    backend = _ScriptedBackend(["\\boxed{5}", "\\boxed{6}"])
    copies = []

    def server():
        copies.append(object())
        return lambda rows, at: list(rows)

    items = [_item("q1"), _item("q2")]
    kept, notes = resample_kept(items, cfg, backend, server, seed=3)
    assert len(copies) == 1 and len(backend.calls) == 1  # one serving copy, one decode for both questions
    rows, params = backend.calls[0]
    assert len(rows) == 4 and params.temperature == cfg.verifier.consistency_temperature
    assert [n["of"] for n in notes] == [2, 2] and [q.question for q in kept] == ["q1", "q2"]

    def broken():
        raise RuntimeError("adapter: shape mismatch")

    kept, notes = resample_kept(items, cfg, backend, broken, seed=3)
    assert kept == [] and len(backend.calls) == 1  # nothing decoded
    assert notes == [
        {"question_hash": question_hash(q), "failed": "RuntimeError: adapter: shape mismatch"} for q in ("q1", "q2")
    ]


def test_resampling_is_planned_at_load_and_needs_a_backend(tmp_path):
    with pytest.raises(ConfigError, match="stream.tuning.replay_samples=2 re-samples .* stream.tuning.replay=0"):
        ELMConfig.load(preset="cpu-tiny", overrides={"stream": {"tuning": {"replay_samples": 2}}})
    with pytest.raises(ConfigError, match="stream.tuning.replay_samples=2 or more"):
        ELMConfig.load(
            preset="cpu-tiny", overrides={"stream": {"tuning": {"replay": 1, "replay_samples": 1, "objective": "grpo"}}}
        )
    grpo = _config(objective="grpo", replay=1, replay_samples=4)
    assert grpo.stream.tuning.replay_samples == 4
    with pytest.raises(ConfigError, match="give the stream memory a backend"):
        StreamMemory(grpo, None, tmp_path, namespace="ns")  # refused before the model is touched


def test_a_replayed_question_is_drawn_again_under_the_version_being_trained(smol, tmp_path):
    cfg = _config(objective="sft", replay=1, replay_samples=3, guard_window=1000)
    backend = _ScriptedBackend(["\\boxed{5}", "\\boxed{6}"], smol.tokenizer)
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns", backend=backend)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    assert stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5").applied
    assert backend.calls == []  # nothing kept yet: no decode
    serving = stream.soft_prompt
    assert stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5").applied
    rows, params = backend.calls[0]
    assert len(rows) == 3 and all(torch.equal(r.soft_prompt, serving) and r.soft_prompt_at == at for r in rows)
    assert params.temperature == cfg.verifier.consistency_temperature and params.stop_at_answer
    assert params.max_new_tokens <= min(cfg.verifier.consistency_max_new_tokens, cfg.generation.max_new_tokens)
    entry = stream.history[-1]
    assert entry["replayed"] == [question_hash("q1")]
    assert entry["resampled"] == [{"question_hash": question_hash("q1"), "agreeing": 2, "of": 3}]
    # re-sampling never reads stored rows: the buffer (and the version file) keeps the questions without them
    assert [(q.question, q.completions) for q in stream.replay.items] == [("q1", []), ("q2", [])]
    assert LatentMemory.load(stream.files.path(stream.version)).meta.config["stream"]["replay"][0]["completions"] == []


def test_a_replayed_question_whose_samples_all_disagree_is_recorded_and_not_learned(smol, tmp_path):
    cfg = _config(objective="sft", replay=1, replay_samples=2, guard_window=1000)
    backend = _ScriptedBackend(["\\boxed{9}"], smol.tokenizer)
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns", backend=backend)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)
    stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5").applied
    entry = stream.history[-1]
    assert "replayed" not in entry  # nothing of q1 to learn from: the update learned from q2 alone
    assert entry["resampled"] == [{"question_hash": question_hash("q1"), "agreeing": 0, "of": 2}]


def test_resampling_with_the_real_backend_decodes_under_the_lora(smol, tiny_backend, tmp_path, monkeypatch):
    cfg = _config(kind="lora", objective="sft", replay=2, replay_samples=2, guard_window=1000)
    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"max_new_tokens": 8})})
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns", backend=tiny_backend)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)
    stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5")
    serving = {k: t.detach().clone() for k, t in stream.adapter().tensors().items()}
    seen = []
    decode = tiny_backend.generate
    monkeypatch.setattr(tiny_backend, "generate", lambda rows, params: seen.append(list(rows)) or decode(rows, params))
    update = stream.learn("q3", ids, at, gens, label="5", version_used=2, zero_shot_answer="5")
    [rows] = seen  # both replayed questions in one call
    assert len(rows) == 4 and len({id(r.memory) for r in rows}) == 1  # one adapter object: one decode batch
    used = rows[0].memory.tensors()
    assert set(used) == set(serving) and all(torch.equal(used[k], serving[k]) for k in serving)
    assert any(bool(t.abs().sum()) for k, t in used.items() if k.endswith(".B"))  # trained: not the base model
    # 8 tokens of a 135M model rarely box a 5: the point is that the decode ran and was counted
    assert update.applied and stream.history[-1]["resampled"][0]["of"] == 2


def test_an_update_learns_the_rows_that_agree_or_skips_when_none_does(smol, tmp_path):
    assert learnable_rows([0.0, 1.0, 1.0], [False, True, True], "sft")[0] == [1, 2]
    assert learnable_rows([0.0, 0.0], [False, True], "sft")[0] == []
    assert learnable_rows([1.0, 0.0, 0.0], [False, True, True], "grpo")[0] == []  # the samples' rewards are uniform
    # a label no generation agrees with (possible with min_label_share 0): skipped, nothing written
    stream = StreamMemory(_config(objective="sft", min_label_share=0.0), smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    update = stream.learn(
        "q1", ids, at, _gens(smol.tokenizer, ["\\boxed{6}"] * 3), label="5", version_used=0, zero_shot_answer=None
    )
    assert (update.applied, update.skipped, stream.version) == (False, "no_agreeing", 0)


def test_a_failed_resample_costs_the_replay_not_the_update(smol, tmp_path):
    cfg = _config(objective="sft", replay=1, replay_samples=2, guard_window=1000)

    class _Failing(_ScriptedBackend):
        def generate(self, prompts, params):
            raise RuntimeError("out of memory")

    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns", backend=_Failing([]))
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)
    stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    update = stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5")
    assert update.applied and stream.version == 2  # q2's own rows were learned
    entry = stream.history[-1]
    assert entry["question_hash"] == question_hash("q2") and "replayed" not in entry
    assert entry["resampled"] == [{"question_hash": question_hash("q1"), "failed": "RuntimeError: out of memory"}]
