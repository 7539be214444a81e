"""The stream memory: versioned updates from the answer path's generations, the collapse guard, rollback,
failure and two learners on one namespace (SmolLM2-135M in float32, real weights, a few tokens)."""

from __future__ import annotations

import threading

import pytest
import torch

from elm_memory.config import ELMConfig
from elm_memory.errors import MemoryFormatError
from elm_memory.memory import LatentMemory
from elm_memory.store.stream_files import StreamFiles, folder_name
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_guard import CollapseGuard, Observation, answer_entropy
from elm_memory.training.stream_samples import Generated


def _config(**stream) -> ELMConfig:
    return ELMConfig.load(
        preset="cpu-tiny", overrides={"verifier": {"name": "consistency"}, "stream": {"mode": "stream", **stream}}
    )


def _gens(tokenizer, texts, greedy_first=True) -> list[Generated]:
    from elm_memory.answers import extract_answer

    out = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Generated(ids, extract_answer(text), sampled=not (greedy_first and i == 0)))
    return out


def _prompt(smol, question="What is 2 + 3?"):
    from elm_memory.backends.prompting import PromptBuilder

    p = PromptBuilder(smol.tokenizer).answer_prompt(question, memory_tokens=20)
    return p.token_ids, p.memory_at


def _poisoned_backward(self, *args, **kwargs):
    """In place of ``StreamMemory._backward``: NaN gradients on every tensor of the memory."""
    for p in self.params.values():
        p.grad = torch.full_like(p, float("nan"))
    return 0.0


# -- the guard (no model) ------------------------------------------------------------------
def _obs(version, answers, zero="1", label=None):
    return Observation(version, answers, zero, label if label is not None else answers[0])


def test_guard_reads_a_window_only_when_full_and_keeps_a_healthy_stream():
    guard = CollapseGuard(window=3)
    assert guard.observe(_obs(0, ["1", "1", "2"])) is None
    assert guard.observe(_obs(1, ["2", "2", "2"])) is None
    verdict = guard.observe(_obs(2, ["3", "3", "4"]))
    assert verdict is not None and verdict.reasons == [] and verdict.rollback_to is None
    assert verdict.stats.versions == [0, 1, 2]
    assert guard.pending == []  # the next window starts empty


def test_guard_rolls_back_when_answers_lose_their_box():
    guard = CollapseGuard(window=2, max_unboxed_increase=0.25)
    guard.observe(_obs(4, [None, None, "1"], zero="1"))
    verdict = guard.observe(_obs(5, [None, None, None], zero="2", label="x"))
    assert verdict is not None and verdict.rollback_to == 4
    assert any("unboxed" in r for r in verdict.reasons)


def test_guard_rolls_back_when_agreement_falls_below_the_first_window():
    guard = CollapseGuard(window=2, max_agreement_drop=0.2, max_repeated_answer=1.0)
    first = [guard.observe(_obs(v, ["7", "7", "7", "7"], label=str(v))) for v in (0, 1)]
    assert first[-1] is not None and first[-1].reasons == []  # the baseline: full agreement
    guard.observe(_obs(2, ["1", "2", "3", "4"], label="1"))
    verdict = guard.observe(_obs(3, ["5", "6", "7", "8"], label="5"))
    assert verdict is not None and verdict.rollback_to == 2 and any("agreement" in r for r in verdict.reasons)


def test_guard_rolls_back_a_rise_in_agreement_only_when_asked_to():
    def run(guard):
        for v in (0, 1):  # the baseline: half the samples agree
            guard.observe(_obs(v, ["1", "1", "2", "3"], label=str(v)))
        guard.observe(_obs(2, ["4", "4", "4", "4"], label="4"))
        return guard.observe(_obs(3, ["5", "5", "5", "6"], label="5"))  # agreement 0.875: a rise of 0.375

    verdict = run(CollapseGuard(window=2, max_agreement_rise=0.3, max_repeated_answer=1.0))
    assert verdict is not None and verdict.rollback_to == 2 and any("agreement 0.88 >" in r for r in verdict.reasons)
    assert run(CollapseGuard(window=2, max_agreement_rise=0.4, max_repeated_answer=1.0)).reasons == []
    assert run(CollapseGuard(window=2, max_repeated_answer=1.0)).reasons == []  # off by default


def test_guard_with_one_answer_a_question_reads_no_agreement():
    # the graph learning from zero-shot's rows gives the guard the memory's greedy answer alone: one answer agrees
    # with itself when boxed, which is the unboxed rule's business, not agreement's
    guard = CollapseGuard(window=2, max_agreement_rise=0.1, max_repeated_answer=1.0)
    for v in range(4):
        verdict = guard.observe(_obs(v, [None if v < 2 else str(v)], zero=None, label=str(v)))
    assert verdict is not None and verdict.stats.agreement is None and verdict.reasons == []
    assert guard.baseline_agreement is None


def test_guard_rolls_back_a_constant_answer():
    guard = CollapseGuard(window=4, max_repeated_answer=0.5)
    for v in range(3):
        guard.observe(_obs(v, ["0", "0"], label="0"))
    verdict = guard.observe(_obs(3, ["9", "9"], label="9"))
    assert verdict is not None and any("one answer" in r for r in verdict.reasons)


def test_guard_state_round_trips():
    guard = CollapseGuard(window=3)
    guard.observe(_obs(0, ["1"]))
    other = CollapseGuard(window=3)
    other.restore(guard.state())
    assert other.pending == guard.pending


def test_guard_reads_a_turn_once_and_its_state_remembers_the_turns_it_read():
    guard = CollapseGuard(window=3)
    assert guard.observe(Observation(0, ["1"], "1", "1", turn="t1")) is None
    assert guard.observe(Observation(0, ["2"], "1", "2", turn="t1")) is None  # its turn re-run after a stop
    assert len(guard.pending) == 1 and guard.read_turns == ["t1"]
    other = CollapseGuard(window=3)
    other.restore(guard.state())
    other.observe(Observation(0, ["2"], "1", "2", turn="t1"))
    assert other.pending == guard.pending and other.read_turns == ["t1"]
    other.restore({"pending": [], "baseline_agreement": None})  # a state written before turns were kept
    assert other.read_turns == [] and other.observe(Observation(0, ["2"], "1", "2", turn="t1")) is None
    assert len(other.pending) == 1


def test_answer_entropy_counts_equivalent_answers_as_one():
    assert answer_entropy(["2", "2.0", "2"]) == 0.0
    assert answer_entropy(["1", "2"]) == pytest.approx(0.6931, abs=1e-3)


# -- the version files ------------------------------------------------------------------
def test_namespace_folders_are_safe_and_distinct(tmp_path):
    assert folder_name("a/b") != folder_name("a_b")
    files = StreamFiles(tmp_path, "../../etc")
    assert files.dir.parent == tmp_path and ".." not in files.dir.name


def test_a_damaged_pending_file_is_a_typed_error_that_says_what_to_do(tmp_path):
    files = StreamFiles(tmp_path, "ns")
    assert files.read_pending(3) is None
    files.write_pending({"version": 3, "guard": {"pending": []}, "pooled": []})
    assert files.read_pending(3) == {"version": 3, "guard": {"pending": []}, "pooled": []}
    assert files.read_pending(4) is None  # of another version: nothing pending since version 4
    for damaged in ('{"version": 3, "guard": {}}', '{"version": 3', "[]", "3"):
        (files.dir / "pending.json").write_text(damaged)
        with pytest.raises(MemoryFormatError, match="pending.json"):
            files.read_pending(3)
    files.delete()
    assert files.read_pending(3) is None


def test_a_version_serves_only_once_written_and_never_goes_back(tmp_path):
    from _fakes import fake_memory, fake_model_info

    files = StreamFiles(tmp_path, "ns")
    assert files.current_version() is None
    with pytest.raises(MemoryFormatError, match="no version yet"):
        files.read()
    mem = fake_memory(fake_model_info())
    with files.lock():
        files.write(0, mem, {})
        files.write(1, mem, {"exp_avg": torch.ones(2)})
        with pytest.raises(MemoryFormatError, match="not after"):
            files.write(1, mem, {})
    assert files.current_version() == 1 and files.versions() == [0, 1]
    _, optim = files.read(1)
    assert torch.equal(optim["exp_avg"], torch.ones(2))


# -- learning (SmolLM2) ------------------------------------------------------------------
@pytest.fixture
def stream(smol, tmp_path):
    return StreamMemory(_config(), smol, tmp_path, namespace="team-a")


def test_a_new_stream_memory_is_its_init_at_version_0(stream):
    assert stream.version == 0
    assert torch.equal(stream.soft_prompt, stream.init["soft_prompt"])
    assert stream.files.current_version() == 0


def test_grpo_update_writes_a_new_version_that_records_its_question_and_label(stream, smol):
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    before = stream.soft_prompt
    update = stream.learn("What is 2 + 3?", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert update.applied and update.version == 1 and update.rewards == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert not torch.equal(stream.soft_prompt, before)
    saved = LatentMemory.load(stream.files.path(1))
    assert torch.allclose(saved.soft_prompt, stream.soft_prompt)
    entry = saved.meta.config["stream"]["entry"]  # a version's header holds its own entry; the log holds them all
    assert stream.files.read_history() == [entry]
    assert entry["question"] == "What is 2 + 3?" and entry["label"] == "5" and entry["trained_from"] == 0
    # version 0 is untouched: it is what served before
    assert torch.equal(LatentMemory.load(stream.files.path(0)).soft_prompt, before)


def test_uniform_rewards_and_weak_votes_skip_without_a_version(stream, smol):
    ids, at = _prompt(smol)
    agreeing = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)
    assert stream.learn("q1", ids, at, agreeing, label="5", version_used=0, zero_shot_answer="5").skipped == (
        "uniform_rewards"
    )
    scattered = _gens(smol.tokenizer, ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}", "\\boxed{5}"])
    assert stream.learn("q2", ids, at, scattered, label="1", version_used=0, zero_shot_answer="1").skipped == (
        "weak_label"
    )
    assert stream.learn("q3", ids, at, scattered, label=None, version_used=0, zero_shot_answer=None).skipped == (
        "no_label"
    )
    assert stream.version == 0 and stream.files.versions() == [0]


def test_sft_learns_from_the_agreeing_generations(smol, tmp_path):
    stream = StreamMemory(_config(objective="sft"), smol, tmp_path)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}"] * 5)  # all agree: no GRPO signal, but SFT has targets
    update = stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert update.applied and update.loss is not None and update.loss > 0 and update.moved > 0


def test_a_non_finite_update_leaves_the_last_good_version_serving(stream, smol, monkeypatch):
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    before = stream.soft_prompt

    def poisoned(self, *args, **kwargs):
        self.soft.grad = torch.full_like(self.soft, float("nan"))
        return 0.0

    monkeypatch.setattr(StreamMemory, "_backward", poisoned)
    update = stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert update.skipped == "non_finite" and not update.applied
    assert stream.version == 0 and torch.equal(stream.soft_prompt, before)
    assert stream.files.versions() == [0]


def test_the_guard_rolls_back_to_the_version_that_opened_the_window(smol, tmp_path):
    stream = StreamMemory(_config(guard_window=2, guard_max_unboxed_increase=0.1), smol, tmp_path)
    ids, at = _prompt(smol)
    good = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    first = stream.learn("q1", ids, at, good, label="5", version_used=0, zero_shot_answer="5")  # window opens at v0
    assert first.applied and stream.version == 1
    unboxed = _gens(smol.tokenizer, ["no box", "none", "\\boxed{5}", "still none", "nope"])
    update = stream.learn("q2", ids, at, unboxed, label="5", version_used=1, zero_shot_answer="5")
    assert update.skipped == "rolled_back" and update.guard is not None and update.guard["rollback_to"] == 0
    assert stream.version == 2 and torch.equal(stream.soft_prompt, stream.init["soft_prompt"])
    history = stream.files.read_history()
    assert history[-1]["rollback_to"] == 0 and history[-1]["reasons"]
    assert LatentMemory.load(stream.files.path(2)).meta.config["stream"]["entry"] == history[-1]
    assert stream.summary()["rollbacks"][0]["to"] == 0


def test_two_learners_on_one_namespace_serialise_no_update_lost_or_doubled(smol, tmp_path):
    cfg = _config(guard_window=1000)
    a = StreamMemory(cfg, smol, tmp_path, namespace="shared")
    b = StreamMemory(cfg, smol, tmp_path, namespace="shared")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    errors: list[BaseException] = []

    def run(learner, tag):
        try:
            for i in range(3):
                learner.learn(f"{tag}{i}", ids, at, gens, label="5", version_used=learner.version, zero_shot_answer="5")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m, t)) for m, t in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    history = a.files.read_history()
    assert a.files.current_version() == 6
    assert sorted(h["question"] for h in history) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert [h["trained_from"] for h in history] == list(range(6))  # each built on the one before


def test_a_second_process_continues_from_the_newest_version(smol, tmp_path):
    cfg = _config()
    first = StreamMemory(cfg, smol, tmp_path)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    first.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    again = StreamMemory(cfg, smol, tmp_path)
    assert again.version == 1 and torch.equal(again.soft_prompt, first.soft_prompt)
    assert again.optim.state[again.soft]["exp_avg"].abs().sum() > 0  # the optimizer's moments came along
    again.restore_version(0, reason="test")
    assert again.version == 2 and torch.equal(again.soft_prompt, again.init["soft_prompt"])


# -- in the graph ------------------------------------------------------------------------
def _stream_elm(smol, tmp_path, texts, **stream):
    from _fakes import ScriptedRollouts, stream_graph_config

    from elm_memory import ELM
    from elm_memory.backends.hf import HFBackend

    cfg = stream_graph_config(tmp_path, **stream)
    return ELM(cfg, loaded=smol, backend=ScriptedRollouts(HFBackend(smol), texts))


def test_the_graph_answers_with_the_stream_memory_and_learns_from_its_own_generations(smol, tmp_path):
    with _stream_elm(smol, tmp_path, ["so \\boxed{5}"], objective="sft") as elm:
        first = elm.answer("What is 2 + 3?")
        assert first.route == "vote" and first.answer == "5"
        assert [c["kind"] for c in first.candidates] == ["zero_shot", "stream"]
        assert first.stream_update["version_used"] == 0 and first.stream_update["applied"]
        second = elm.answer("What is 1 + 4?")
        assert second.stream_update["version_used"] == 1 and second.stream_update["version"] == 2
        stream = elm.services().stream_memory("default")
        history = stream.files.read_history()
        assert [h["question"] for h in history] == ["What is 2 + 3?", "What is 1 + 4?"]
        # the samples were drawn under the stream memory (on-policy): every sample row carried its soft prompt
        backend = elm.backend
        assert sum(p.soft_prompt is not None for p in backend.calls) == 2 * (1 + 3)


def test_learn_false_answers_with_the_stream_memory_and_leaves_it_as_it_was(smol, tmp_path):
    with _stream_elm(smol, tmp_path, ["\\boxed{5}"], objective="sft") as elm:
        result = elm.answer("What is 2 + 3?", learn=False)
        assert result.answer == "5" and result.stream_update is None
        assert elm.services().stream_memory("default").version == 0


def test_a_threads_run_without_learning_does_not_report_the_previous_runs_update(smol, tmp_path):
    from langgraph.checkpoint.memory import InMemorySaver

    from elm_memory.graph import build_elm_graph

    with _stream_elm(smol, tmp_path, ["\\boxed{5}"], objective="sft") as elm:
        graph = build_elm_graph(elm.services(), checkpointer=InMemorySaver())
        cfg = {"configurable": {"thread_id": "t1"}}
        graph.invoke({"question": "What is 2 + 3?"}, cfg)
        assert graph.get_state(cfg).values["stream_update"]["version"] == 1
        graph.invoke({"question": "What is 1 + 4?", "learn": False}, cfg)
        assert graph.get_state(cfg).values["stream_update"] is None


def test_stream_mode_without_a_sampling_verifier_is_refused_at_load():
    from elm_memory.errors import ConfigError

    with pytest.raises(ConfigError, match="verifier.name=consistency"):
        ELMConfig.load(overrides={"stream": {"mode": "stream"}, "verifier": {"name": "prm"}})
    assert ELMConfig.load(overrides={"stream": {"mode": "both"}, "verifier": {"name": "consistency"}})


# -- the evaluation method ---------------------------------------------------------------
@pytest.mark.model
def test_elm_stream_runs_online_beside_zero_shot_format_and_resumes(
    evidence_config, tiny_loaded, tiny_backend, tmp_path
):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    cfg = evidence_config
    problems = load_problems("synth-arith", limit=2, seed=17)
    methods = ["elm_stream", "zero_shot_format"]

    def run(n):
        runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
        return run_stream(
            problems[:n], methods, cfg, tmp_path, dataset="synth-arith", seed=17, runtime=runtime, progress=False
        )

    run(2)
    versions = sorted(str(p) for p in (tmp_path / "stream" / "grpo").rglob("v*.safetensors"))
    run(2)  # a finished run re-run: nothing answered or learned twice
    assert sorted(str(p) for p in (tmp_path / "stream" / "grpo").rglob("v*.safetensors")) == versions
    assert len(RecordLog(tmp_path / "records.jsonl").read()) == 4
    records = RecordLog(tmp_path / "records.jsonl").read()
    stream = [r for r in records if r["method"] == "elm_stream"]
    assert [r["index"] for r in stream] == [0, 1]
    rows = stream[0]["extra"]["stream"]["rows"]
    assert set(rows) >= {"zero_shot", "self_consistency", "format", "init_greedy", "stream_greedy[grpo]"}
    assert stream[0]["extra"]["stream"]["updates"]["grpo"]["version_used"] == 0
    # zero_shot_format answers the same prompt the stream method's format row does: the same answer
    fmt = {r["index"]: r["answer"] for r in records if r["method"] == "zero_shot_format"}
    assert fmt[0] == rows["format"]
    assert (tmp_path / "stream_accuracy.png").exists()
    assert "Planned tests" in (tmp_path / "results.md").read_text()


def test_elm_memories_streams_lists_versions_updates_and_rollbacks(smol, tmp_path):
    import json

    from typer.testing import CliRunner

    from elm_memory.cli.memories import memories_app

    stream = StreamMemory(_config(), smol, tmp_path / "store" / "stream", namespace="team-a")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    stream.restore_version(0, reason="by hand")
    out = CliRunner().invoke(memories_app, ["streams", "--store", str(tmp_path / "store"), "--json"])
    assert out.exit_code == 0, out.output
    [row] = json.loads(out.stdout)
    assert (row["namespace"], row["version"], row["updates"], row["versions_written"]) == ("team-a", 2, 1, 3)
    assert row["kind"] == "soft_prompt"
    assert row["rollbacks"] == [{"version": 2, "to": 0, "reasons": ["by hand"]}]
    assert LatentMemory.load(row["path"]).meta.config["stream"]["version"] == 2


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_elm_stream_gold_arm_learns_from_the_dataset_answer_after_the_rows_were_drawn(
    evidence_config, tiny_loaded, tiny_backend, tmp_path
):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    cfg = evidence_config.model_copy(
        update={
            "stream": evidence_config.stream.model_copy(
                update={"tuning": evidence_config.stream.tuning.model_copy(update={"min_label_share": 0.0})}
            )
        }
    )
    problems = load_problems("synth-arith", limit=2, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    run_stream(
        problems, ["elm_stream_gold"], cfg, tmp_path, dataset="synth-arith", seed=17, runtime=runtime, progress=False
    )
    records = RecordLog(tmp_path / "records.jsonl").read()
    assert [r["index"] for r in records] == [0, 1]
    for r in records:
        stream = r["extra"]["stream"]
        assert stream["label_sources"] == {"grpo": "vote", "grpo_gold": "gold"}
        assert stream["updates"]["grpo_gold"]["label"] == r["gold"]
        assert stream["updates"]["grpo"]["label"] == stream["rows"]["stream_vote[grpo]"]
        assert r["answer"] == stream["rows"]["stream_vote[grpo]"]  # the gold arm never answers
    assert (tmp_path / "stream" / "grpo_gold").is_dir() and (tmp_path / "stream" / "grpo").is_dir()


def test_a_stream_evaluation_refuses_a_gold_first_arm_and_an_unknown_label(evidence_config, tmp_path):
    from elm_memory.errors import ConfigError
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.methods.stream_method import Arm, StreamEval

    with pytest.raises(ConfigError, match="label must be one of"):
        Arm("x", "grpo", label="oracle")
    runtime = EvalRuntime(evidence_config, tmp_path, loaded=None, backend=None)
    with pytest.raises(ConfigError, match="first arm answers"):
        StreamEval(runtime, arms=[Arm("g", "grpo", label="gold"), Arm("v", "grpo")])


def test_old_versions_are_pruned_to_keep_versions_and_a_pruned_one_is_named_when_asked_for(smol, tmp_path):
    from elm_memory.errors import MemoryFormatError
    from elm_memory.store.stream_files import list_streams

    stream = StreamMemory(_config(guard_window=2, keep_versions=4), smol, tmp_path / "s", namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    for _ in range(6):
        stream.learn("q", ids, at, gens, label="5", version_used=stream.version, zero_shot_answer="5")
    assert stream.version == 6
    assert stream.files.versions() == [3, 4, 5, 6]
    # optimizer moments: the newest two versions only (a LoRA's are twice its size)
    assert sorted(p.name for p in stream.files.dir.glob("*.optim.safetensors")) == [
        f"v{v:06d}.optim.safetensors" for v in (5, 6)
    ]
    with pytest.raises(MemoryFormatError, match="no version 1 on disk .*kept: v3..v6"):
        stream.files.read(1)
    # the newest file still carries every update's record
    [row] = list_streams(tmp_path / "s")
    assert (row["version"], row["versions_written"], row["versions_kept"]) == (6, 7, 4)
    assert row["updates"] + len(row["rollbacks"]) == 6  # (this window-2 guard rolls back a repeated answer)
    stream.restore_version(4, reason="by hand")  # a kept version restores (its moments gone: a fresh optimizer)
    assert stream.files.versions() == [4, 5, 6, 7] and stream.optim.state == {}
    assert torch.equal(stream.soft_prompt, LatentMemory.load(stream.files.path(4)).soft_prompt)


def test_keep_versions_keeps_at_least_the_newest_two():
    assert _config(guard_window=2, keep_versions=1).stream.versions_to_keep == 2
    assert _config(guard_window=1000, keep_versions=3).stream.versions_to_keep == 3  # the guard's target is pinned
    assert _config(guard_window=2, keep_versions=0).stream.versions_to_keep == 0  # 0: keep all


@pytest.mark.model
def test_a_stream_memory_version_exports_as_a_file_and_as_a_peft_adapter_that_peft_loads(smol, tmp_path):
    import json

    import peft
    from typer.testing import CliRunner

    from elm_memory.cli.memories import memories_app
    from elm_memory.config import ModelConfig
    from elm_memory.models.loading import load_model

    stream = StreamMemory(_config(), smol, tmp_path / "store" / "stream", namespace="team-a")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert stream.version == 1
    run = CliRunner().invoke
    common = ["--store", str(tmp_path / "store"), "--namespace", "team-a"]

    out = run(memories_app, ["export", "--stream", "--version", "0", str(tmp_path / "v0.safetensors"), *common])
    assert out.exit_code == 0, out.output
    assert torch.equal(LatentMemory.load(tmp_path / "v0.safetensors").soft_prompt, stream.init["soft_prompt"])

    out = run(memories_app, ["export", "--stream", "--format", "peft", str(tmp_path / "adapter"), *common, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["written"] == [str(tmp_path / "adapter")]
    base = load_model(ModelConfig(name_or_path="packaged:smollm2-135m", dtype="float32", device="cpu")).model
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    loaded = model.prompt_encoder["default"].embedding.weight.detach()
    assert torch.equal(loaded, stream.soft_prompt.detach().to(torch.float32))  # the serving version, trained

    out = run(memories_app, ["export", "--stream", "--version", "9", str(tmp_path / "x.safetensors"), *common])
    assert out.exit_code != 0 and "no version 9 on disk" in out.output
    out = run(memories_app, ["export", "--stream", str(tmp_path / "x.safetensors"), "--store", str(tmp_path / "store")])
    assert out.exit_code != 0 and "has no stream memory" in out.output


def test_update_every_pools_questions_into_one_step_and_one_version(smol, tmp_path):
    from elm_memory.store.stream_files import list_streams

    stream = StreamMemory(_config(update_every=3, guard_window=1000), smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    before = stream.soft_prompt
    first = stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    weak = stream.learn("q2", ids, at, gens, label="7", version_used=0, zero_shot_answer="5")  # 1 of 5: not pooled
    second = stream.learn("q3", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert (first.skipped, weak.skipped, second.skipped) == ("pooled (1 of 3)", "weak_label", "pooled (2 of 3)")
    assert stream.version == 0 and torch.equal(stream.soft_prompt, before) and stream.files.versions() == [0]
    third = stream.learn("q4", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert third.applied and third.version == 1 and not torch.equal(stream.soft_prompt, before)
    entry = stream.history[-1]
    assert [b["question"] for b in entry["batch"]] == ["q1", "q3", "q4"] and entry["label"] == "5"
    assert stream.pooled == []
    [row] = list_streams(tmp_path)
    assert (row["version"], row["updates"]) == (1, 1)


def test_a_rollback_empties_the_pool(smol, tmp_path):
    stream = StreamMemory(_config(update_every=4, guard_window=1000), smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    stream.learn("q1", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert len(stream.pooled) == 1
    stream.restore_version(0, reason="by hand")
    assert stream.pooled == []


def test_a_restarted_process_keeps_the_pool_and_the_guards_readings_and_shares_them(smol, tmp_path):
    from elm_memory.cli.memory_views import stream_lines
    from elm_memory.store.stream_files import list_streams

    cfg = _config(update_every=3, guard_window=1000)
    stream = StreamMemory(cfg, smol, tmp_path, namespace="ns")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])

    def learn(memory, question, label="5", version_used=0, turn=None):
        return memory.learn(
            question, ids, at, gens, label=label, version_used=version_used, zero_shot_answer="5", turn=turn
        )

    assert learn(stream, "q1", turn="t1").skipped == "pooled (1 of 3)"
    assert learn(stream, "q2", label="7", turn="t2").skipped == "weak_label"  # read by the guard, not pooled
    [row] = list_streams(tmp_path)  # what `elm memories streams` shows of it
    assert row["pending"] == {"pooled": 1, "update_every": 3, "guard_readings": 2, "guard_window": 1000}
    assert "    since v0: 1 of 3 questions pooled for the next update, 2 of 1000 readings in the guard's window" in (
        stream_lines([row])
    )
    restarted = StreamMemory(cfg, smol, tmp_path, namespace="ns")
    assert [(p.question, p.turn) for p in restarted.pooled] == [("q1", "t1")]
    assert restarted.guard.state() == stream.guard.state() and len(restarted.guard.pending) == 2
    # a graph re-runs the learn node its turn stopped in: neither pooled nor read again
    assert learn(restarted, "q1", turn="t1").skipped == "learned_already"
    assert learn(restarted, "q2", label="7", turn="t2").skipped == "weak_label"
    assert len(restarted.guard.pending) == 2
    assert learn(restarted, "q3").skipped == "pooled (2 of 3)"
    assert learn(stream, "q4").applied  # the first process pools with the second: one pool per namespace
    assert [b["question"] for b in stream.history[-1]["batch"]] == ["q1", "q3", "q4"]
    assert learn(restarted, "q5", version_used=1).skipped == "pooled (1 of 3)"  # the new version's pool
    assert [p.question for p in restarted.pooled] == ["q5"] and len(restarted.guard.pending) == 5
    [row] = list_streams(tmp_path)
    assert (row["version"], row["pending"]["pooled"], row["pending"]["guard_readings"]) == (1, 1, 5)


# -- a lora stream memory ------------------------------------------------------------------
def test_a_lora_stream_memory_starts_as_the_base_model_learns_and_continues_in_a_new_process(smol, tmp_path):
    from elm_memory.backends.base import PromptInput
    from elm_memory.backends.teacher_forcing import completion_logprobs

    cfg = _config(kind="lora")
    stream = StreamMemory(cfg, smol, tmp_path, namespace="team-a")
    assert stream.kind == "lora" and stream.init_is_base_model and cfg.stream.lr == 1e-4
    assert all(not t.any() for n, t in stream.init.items() if n.endswith(".B"))
    ids, at = _prompt(smol)
    completion = smol.tokenizer("so \\boxed{5}", add_special_tokens=False)["input_ids"]
    [served] = stream.serve([PromptInput(tuple(ids))], at)
    assert served.memory is not None and served.soft_prompt is None
    [again_served] = stream.serve([PromptInput(tuple(ids))], at)
    assert again_served.memory is served.memory  # one copy per version, not per call
    with torch.no_grad():  # B = 0: the untrained memory scores every token exactly as the base model does
        under, _ = completion_logprobs(smol.model, [served], [completion])
        base, _ = completion_logprobs(smol.model, [PromptInput(tuple(ids))], [completion])
    assert torch.equal(under, base)

    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    update = stream.learn("What is 2 + 3?", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert update.applied and update.version == 1 and update.moved > 0
    saved = LatentMemory.load(stream.files.path(1))
    assert saved.kind == "lora" and saved.meta.config["stream"]["entry"]["label"] == "5"
    assert any(t.any() for n, t in saved.params.items() if n.endswith(".B"))  # the update moved B off zero
    with torch.no_grad():
        [now] = stream.serve([PromptInput(tuple(ids))], at)
        trained, _ = completion_logprobs(smol.model, [now], [completion])
    assert not torch.equal(trained, base)
    assert now.memory is not served.memory and now.memory.digest() != served.memory.digest()  # a new version's copy

    again = StreamMemory(cfg, smol, tmp_path, namespace="team-a")  # another process: the same version and moments
    assert again.version == 1
    assert all(torch.equal(again.params[n], stream.params[n]) for n in stream.params)
    assert again._optimizer_state().keys() == stream._optimizer_state().keys() != set()
    assert again.summary()["kind"] == "lora" and again.summary()["updates"] == 1


def test_a_non_finite_lora_update_leaves_the_last_good_version_serving(smol, tmp_path, monkeypatch):
    stream = StreamMemory(_config(kind="lora"), smol, tmp_path)
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    before = {n: p.detach().clone() for n, p in stream.params.items()}
    monkeypatch.setattr(StreamMemory, "_backward", _poisoned_backward)
    served = stream.adapter()
    update = stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    assert update.skipped == "non_finite" and stream.version == 0 and stream.files.versions() == [0]
    assert all(torch.equal(stream.params[n], before[n]) for n in before)
    # the copy served now is made from the restored tensors, not from the poisoned step's
    assert stream.adapter() is not served and stream.adapter().digest() == served.digest()


def test_a_stream_memory_of_another_kind_on_disk_is_refused_by_name(smol, tmp_path):
    from elm_memory.errors import MemoryKindError

    StreamMemory(_config(), smol, tmp_path, namespace="team-a")
    with pytest.raises(MemoryKindError, match="stream.kind=soft_prompt"):
        StreamMemory(_config(kind="lora"), smol, tmp_path, namespace="team-a")
    with pytest.raises(MemoryKindError, match="not a lora memory"):
        StreamMemory(_config(), smol, tmp_path, namespace="team-a").adapter()


def test_a_lora_stream_memory_exports_as_a_peft_lora_adapter_that_peft_loads(smol, tmp_path):
    import peft
    from typer.testing import CliRunner

    from elm_memory.cli.memories import memories_app
    from elm_memory.config import ModelConfig
    from elm_memory.models.loading import load_model

    stream = StreamMemory(_config(kind="lora"), smol, tmp_path / "store" / "stream", namespace="team-a")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5")
    common = ["--store", str(tmp_path / "store"), "--namespace", "team-a"]
    out = CliRunner().invoke(memories_app, ["export", "--stream", "--format", "peft", str(tmp_path / "ad"), *common])
    assert out.exit_code == 0, out.output
    base = load_model(ModelConfig(name_or_path="packaged:smollm2-135m", dtype="float32", device="cpu")).model
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    name = "model.layers.0.self_attn.q_proj"
    module = dict(model.base_model.model.named_modules())[name]
    assert torch.equal(module.lora_B["default"].weight.detach(), stream.params[f"lora.{name}.B"].detach())


def test_the_graph_answers_with_a_lora_stream_memory_and_learns(smol, tmp_path):
    with _stream_elm(smol, tmp_path, ["so \\boxed{5}"], objective="sft", kind="lora") as elm:
        first = elm.answer("What is 2 + 3?")
        assert first.answer == "5" and first.stream_update["applied"] and first.stream_update["version"] == 1
        # the stream memory's greedy row and its samples carried the lora; the zero-shot row did not
        assert sum(p.memory is not None for p in elm.backend.calls) == 1 + 3
        assert elm.services().stream_memory("default").summary()["kind"] == "lora"


@pytest.mark.model
def test_elm_stream_with_a_lora_memory_reports_its_init_as_zero_shot_and_learns(
    evidence_config, tiny_loaded, tiny_backend, tmp_path
):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    cfg = evidence_config.model_copy(update={"stream": evidence_config.stream.model_copy(update={"kind": "lora"})})
    problems = load_problems("synth-arith", limit=2, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    run_stream(problems, ["elm_stream"], cfg, tmp_path, dataset="synth-arith", seed=17, runtime=runtime, progress=False)
    records = RecordLog(tmp_path / "records.jsonl").read()
    for r in records:
        extra = r["extra"]["stream"]
        assert extra["kind"] == "lora" and extra["init_is_zero_shot"]
        assert extra["rows"]["init_greedy"] == extra["rows"]["zero_shot"]
        assert extra["versions"]["grpo"] <= r["index"]  # one version per applied update at most
    assert LatentMemory.load(next((tmp_path / "stream" / "grpo").rglob("v000000.safetensors"))).kind == "lora"


def test_deleting_a_stream_memory_starts_it_again_from_its_init_and_drops_what_the_deleted_one_drew(smol, tmp_path):
    from typer.testing import CliRunner

    from elm_memory.cli.memories import memories_app
    from elm_memory.store.stream_files import list_streams

    root = tmp_path / "store" / "stream"
    stream = StreamMemory(_config(), smol, root, namespace="team-a")
    ids, at = _prompt(smol)
    gens = _gens(smol.tokenizer, ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{7}"])
    assert stream.learn("q", ids, at, gens, label="5", version_used=0, zero_shot_answer="5").applied
    run = CliRunner().invoke
    out = run(memories_app, ["delete", "--stream", "--store", str(tmp_path / "store")])
    assert out.exit_code != 0 and "--namespace" in out.output  # which namespace is never guessed
    out = run(memories_app, ["delete", "--stream", "--store", str(tmp_path / "store"), "--namespace", "team-a"])
    assert out.exit_code == 0 and "deleted 2 versions" in out.output, out.output
    assert list_streams(root) == []
    out = run(memories_app, ["delete", "--stream", "--store", str(tmp_path / "store"), "--namespace", "team-a"])
    assert out.exit_code != 0 and "has no stream memory" in out.output
    # the learner still holding version 1 learns next: drawn by the deleted memory, so no update; v0 again
    update = stream.learn("q2", ids, at, gens, label="5", version_used=1, zero_shot_answer="5")
    assert update.skipped == "stream_deleted" and update.version == 0
    assert stream.files.versions() == [0] and torch.equal(stream.soft_prompt, stream.init["soft_prompt"])
    assert stream.history == [] and stream.summary()["updates"] == 0


@pytest.mark.model
def test_a_second_resume_keeps_the_copy_the_first_one_made_and_its_optimizer(evidence_config, tiny_loaded, tmp_path):
    # a process stopped after an update it did not record resumes by restoring the recorded version (a new one);
    # stopped again before its next record, it must not restore that version twice: its moments are pruned by then
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.methods.stream_method import StreamEval

    stream = evidence_config.stream.model_copy(
        update={"tuning": evidence_config.stream.tuning.model_copy(update={"objective": "sft"})}
    )
    cfg = evidence_config.model_copy(update={"stream": stream})

    def process() -> tuple[StreamEval, StreamMemory]:
        method = StreamEval(EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=None))
        return method, method.arms["sft"]

    _, arm = process()
    ids, at = _prompt(tiny_loaded)
    gens = _gens(tiny_loaded.tokenizer, ["\\boxed{5}"] * 3)
    for v in (0, 1):
        assert arm.learn("q", ids, at, gens, label="5", version_used=v, zero_shot_answer="5").applied
    records = [{"index": 0, "extra": {"stream": {"updates": {"sft": {"version": 1}}}}}]  # v2 went unrecorded
    method, arm = process()
    method.resume(records)
    assert arm.version == 3 and arm.history[-1]["rollback_to"] == 1 and arm.optim.state
    method, arm = process()  # stopped again before the next record
    method.resume(records)
    assert arm.version == 3 and arm.optim.state  # served as it was, moments and all
