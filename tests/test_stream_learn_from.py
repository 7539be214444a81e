"""``stream.tuning.learn_from: zero_shot``: the stream memory learns from zero-shot's greedy answer and the samples
drawn without it, labelled by self-consistency's vote, while the guard watches the memory's own answers (SmolLM2-135M,
real weights; a scripted backend answers one way with the memory and another without it)."""

from __future__ import annotations

import pytest

from elm_memory.backends.base import Generation, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.memory import LatentMemory
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_samples import Generated

WITH_MEMORY, WITHOUT = "\\boxed{7}", "\\boxed{5}"


class MemorySensitive:
    """Answers ``WITH_MEMORY`` for a row under a memory (soft prompt or adapter), else ``WITHOUT``: which rows
    were drawn with the memory shows in every answer."""

    name = "scripted"

    def __init__(self, real):
        self.tokenizer, self.info = real.tokenizer, real.info
        self.calls: list = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.extend(prompts)
        out = []
        for p in prompts:
            text = WITH_MEMORY if (p.soft_prompt is not None or p.memory is not None) else WITHOUT
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            out.append([Generation(text=text, token_ids=ids, finish_reason="stop") for _ in range(params.n)])
        return out


def test_learning_from_zero_shot_needs_the_sft_objective_which_it_takes_unless_told_otherwise():
    with pytest.raises(ConfigError, match="stream.tuning.objective=sft"):
        ELMConfig.load(overrides={"stream": {"tuning": {"learn_from": "zero_shot", "objective": "grpo"}}})
    cfg = ELMConfig.load(overrides={"stream": {"tuning": {"learn_from": "zero_shot"}}})
    assert (cfg.stream.tuning.learn_from, cfg.stream.tuning.objective) == ("zero_shot", "sft")


def test_the_guard_watches_the_answers_the_memory_served_not_the_rows_it_learned_from(smol, tmp_path):
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={"verifier": {"name": "consistency"}, "stream": {"mode": "stream", "tuning": {"objective": "sft"}}},
    )
    stream = StreamMemory(cfg, smol, tmp_path)
    ids = smol.tokenizer(WITHOUT, add_special_tokens=False)["input_ids"]
    learned = [Generated(ids, "5", sampled=i > 0) for i in range(4)]
    update = stream.learn(
        "q", [1, 2, 3], 3, learned, label="5", version_used=0, zero_shot_answer="5", served_answers=["7", None, "7"]
    )
    assert update.applied and update.rewards == [1.0] * 4  # trained on the zero-shot rows, labelled by their vote
    seen = stream.guard.pending[-1]
    assert seen.memory_answers == ["7", None, "7"]
    assert seen.label == "7"  # the repeated-answer rule counts the memory's own vote, not the label it learned


def _graph(smol, tmp_path, learn_from):
    from _fakes import stream_graph_config

    from elm_memory import ELM

    cfg = stream_graph_config(tmp_path, objective="sft", learn_from=learn_from)
    return ELM(cfg, loaded=smol, backend=MemorySensitive(smol))


def test_the_graph_learning_from_zero_shot_samples_without_the_memory_and_learns_their_vote(smol, tmp_path):
    with _graph(smol, tmp_path, "zero_shot") as elm:
        result = elm.answer("What is 2 + 3?")
        by_kind = {c["kind"]: c["answer"] for c in result.candidates}
        assert by_kind == {"zero_shot": "5", "stream": "7"}
        assert result.answer == "5"  # the memory's greedy 7 among three unconditioned samples (5, 5, 5)
        assert result.stream_update["applied"] and result.stream_update["label"] == "5"
        stream = elm.services().stream_memory("default")
        entry = LatentMemory.load(stream.files.path(1)).meta.config["stream"]["entry"]
        assert stream.files.read_history() == [entry]  # the log holds it too
        assert entry["label"] == "5"
        assert stream.guard.pending[-1].memory_answers == ["7"]  # the guard saw the memory's own answer
        assert sum(p.soft_prompt is not None for p in elm.backend.calls) == 1  # its greedy row only


def test_the_graph_learning_from_its_own_samples_draws_them_under_the_memory(smol, tmp_path):
    with _graph(smol, tmp_path, "own") as elm:
        result = elm.answer("What is 2 + 3?")
        assert result.answer == "7" and result.stream_update["label"] == "7"
        assert sum(p.soft_prompt is not None for p in elm.backend.calls) == 1 + 3


@pytest.mark.model
@pytest.mark.parametrize("learn_from", ["zero_shot", "own"])
def test_elm_stream_learning_from_zero_shot_trains_on_self_consistencys_vote(
    evidence_config, tiny_loaded, tmp_path, learn_from
):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    stream = evidence_config.stream.model_copy(
        update={
            "tuning": evidence_config.stream.tuning.model_copy(update={"objective": "sft", "learn_from": learn_from})
        }
    )
    cfg = evidence_config.model_copy(update={"stream": stream})
    problems = load_problems("synth-arith", limit=1, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=MemorySensitive(tiny_loaded))
    run_stream(problems, ["elm_stream"], cfg, tmp_path, dataset="synth-arith", seed=17, runtime=runtime, progress=False)
    [record] = RecordLog(tmp_path / "records.jsonl").read()
    extra = record["extra"]["stream"]
    rows = extra["rows"]
    assert rows["self_consistency"] == "5" and rows["stream_greedy[sft]"] == "7" and rows["stream_vote[sft]"] == "7"
    assert extra["updates"]["sft"]["applied"]
    if learn_from == "zero_shot":
        assert rows["stream_zs_vote[sft]"] == "5"  # its greedy 7 among the zero-shot samples
        assert extra["updates"]["sft"]["label"] == "5"  # self-consistency's vote, not its own
    else:
        assert "stream_zs_vote[sft]" not in rows and extra["updates"]["sft"]["label"] == "7"
    # the graph's turn answers and learns: with zero_shot its greedy 7 among the zero-shot samples, the guard
    # reading its greedy answer alone; with own its vote, the guard reading its greedy 7 and its 3 samples under it
    assert record["answer"] == ("5" if learn_from == "zero_shot" else "7")
    tokens = extra["tokens"]  # each answer text is the same few tokens with the memory, and without it
    zero, mine = tokens["zero_shot"], tokens["stream_greedy[sft]"]
    assert tokens["self_consistency"] == 4 * zero
    assert tokens["elm_stream"] == zero + mine + 3 * (zero if learn_from == "zero_shot" else mine)
    [newest] = sorted((tmp_path / "stream" / "sft").rglob("v000001.safetensors"))
    [seen] = LatentMemory.load(newest).meta.config["stream"]["guard"]["pending"]
    assert seen["memory_answers"] == (["7"] if learn_from == "zero_shot" else ["7"] * 4) and seen["label"] == "7"


def test_a_stream_evaluation_learning_from_zero_shot_refuses_a_grpo_arm(evidence_config, tmp_path):
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.methods.stream_method import elm_stream_objectives

    stream = evidence_config.stream.model_copy(
        update={
            "tuning": evidence_config.stream.tuning.model_copy(update={"objective": "sft", "learn_from": "zero_shot"})
        }
    )
    runtime = EvalRuntime(evidence_config.model_copy(update={"stream": stream}), tmp_path, loaded=None, backend=None)
    with pytest.raises(ConfigError, match=r"stream arm 'grpo'.*stream.tuning.objective=sft"):
        elm_stream_objectives(runtime)


def test_an_arm_sets_how_it_learns_but_not_what_it_is(evidence_config):
    from elm_memory.eval.methods.stream_method import Arm

    arm = Arm("fast", "sft", settings=(("learning_rate", 1e-3), ("learn_from", "zero_shot")))
    mine = arm.stream_config(evidence_config.stream)
    assert (mine.lr, mine.tuning.learn_from, mine.tuning.objective) == (1e-3, "zero_shot", "sft")
    assert mine.tuning.guard_window == evidence_config.stream.tuning.guard_window  # the rest is the run's
    with pytest.raises(ConfigError, match="kind cannot differ between arms"):
        Arm("x", "sft", settings=(("kind", "lora"),))
    with pytest.raises(ConfigError, match="stream arm 'slow'"):
        Arm("slow", "sft", settings=(("learning_rate", -1.0),)).stream_config(evidence_config.stream)
    replaying = Arm("replay", "sft", settings=(("replay", 2), ("replay_buffer", 8))).stream_config(
        evidence_config.stream
    )
    assert (replaying.tuning.replay, replaying.tuning.replay_buffer) == (2, 8)
    with pytest.raises(ConfigError, match=r"stream arm 'pg'.*stream.tuning.replay=2"):  # replay needs sft, per arm too
        Arm("pg", "grpo", settings=(("replay", 2),)).stream_config(evidence_config.stream)
    fresh = Arm("pg", "grpo", settings=(("replay", 2), ("replay_samples", 4))).stream_config(evidence_config.stream)
    assert (fresh.tuning.objective, fresh.tuning.replay_samples) == ("grpo", 4)  # re-sampled replay is on-policy


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_elm_stream_sources_trains_one_arm_on_its_own_vote_and_one_on_self_consistencys(
    evidence_config, tiny_loaded, tmp_path
):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    problems = load_problems("synth-arith", limit=1, seed=17)
    runtime = EvalRuntime(evidence_config, tmp_path, loaded=tiny_loaded, backend=MemorySensitive(tiny_loaded))
    run_stream(
        problems,
        ["elm_stream_sources"],
        evidence_config,
        tmp_path,
        dataset="synth-arith",
        seed=17,
        runtime=runtime,
        progress=False,
    )
    [record] = RecordLog(tmp_path / "records.jsonl").read()
    extra = record["extra"]["stream"]
    assert record["answer"] == extra["rows"]["stream_vote[sft]"] == "7"  # the first arm answers
    assert extra["updates"]["sft"]["label"] == "7" and extra["updates"]["sft_zs"]["label"] == "5"
    assert "stream_zs_vote[sft_zs]" in extra["rows"] and "stream_zs_vote[sft]" not in extra["rows"]
