"""A stream memory's bounded replay (``stream.replay``): which kept questions an update learns from again, how
the buffer is bounded, refused with GRPO, and kept in each version's file through resumes and rollbacks."""

from __future__ import annotations

import json

import pytest
import torch
from test_stream_memory import _config, _gens, _poisoned_backward, _prompt

from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import question_hash
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_replay import PooledQuestion, ReplayBuffer


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


def test_the_buffer_round_trips_through_json():
    buffer = ReplayBuffer(4, [_item("q1"), _item("q2", label="9")])
    again = ReplayBuffer.from_json(4, buffer.to_json())
    assert [q.to_json() for q in again.items] == buffer.to_json()
    assert torch.equal(again.items[1].weights, torch.ones(2)) and again.items[1].label == "9"
    assert len(ReplayBuffer.from_json(1, buffer.to_json())) == 1 and len(ReplayBuffer.from_json(4, None)) == 0


def test_replay_with_a_policy_gradient_is_refused_at_load():
    with pytest.raises(ConfigError, match="stream.replay=2 .* set stream.objective=sft"):
        ELMConfig.load(preset="cpu-tiny", overrides={"stream": {"replay": 2, "objective": "grpo"}})
    assert ELMConfig.load(preset="cpu-tiny", overrides={"stream": {"replay": 2, "objective": "sft"}}).stream.replay == 2


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
