"""The evaluation harness: datasets, the greedy cache, the online and offline protocols on the
real tiny model (cpu-tiny preset), resume after a kill, and the files a run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elm_memory.backends.base import Generation, PromptInput, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import load_problems
from elm_memory.errors import ConfigError
from elm_memory.eval.cache import GreedyCache
from elm_memory.eval.methods.text_memory import parse_verdict
from elm_memory.eval.records import RecordLog

PNG = b"\x89PNG\r\n\x1a\n"


def tiny_config(**over) -> ELMConfig:
    return ELMConfig.load(preset="cpu-tiny", overrides={"generation": {"max_new_tokens": 12}, **over})


# ---- datasets ---------------------------------------------------------------------------------


def test_seeded_order_is_a_deterministic_sample_of_the_whole_set():
    a = load_problems("gsm8k", limit=5, seed=17)
    assert [p.id for p in a] == [p.id for p in load_problems("gsm8k", limit=5, seed=17)]
    assert [p.id for p in a] != [p.id for p in load_problems("gsm8k", limit=5, seed=42)]
    assert [p.id for p in load_problems("gsm8k", limit=3, seed=None)] == ["gsm8k-0000", "gsm8k-0001", "gsm8k-0002"]
    assert len(load_problems("aime24")) == 30 and len(load_problems("amc23")) == 40


def test_jsonl_datasets_and_their_errors(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"question": "1+1?", "answer": 2}\n\n{"id": "q9", "question": "2+2?", "answer": "4"}\n')
    problems = load_problems(str(good))
    assert [(p.id, p.answer) for p in problems] == [("mine-1", "2"), ("q9", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_problems(str(bad))
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "question": "x", "answer": 1}\n{"id": "a", "question": "y", "answer": 2}\n')
    with pytest.raises(ConfigError, match="duplicate id"):
        load_problems(str(dup))
    with pytest.raises(ConfigError, match="neither a vendored name"):
        load_problems("gsm9k")


# ---- small pure parts ----------------------------------------------------------------------


def test_record_log_ignores_a_line_cut_by_a_kill(tmp_path):
    log = RecordLog(tmp_path / "r.jsonl")
    log.append({"a": 1})
    with open(log.path, "ab") as fh:
        fh.write(b'{"a": 2, "cut')  # the kill happened mid-write
    assert log.read() == [{"a": 1}]
    log.append({"a": 3})  # starts on a fresh line, so the next record is intact
    assert log.read() == [{"a": 1}, {"a": 3}]


def test_parse_verdict_takes_the_last_and_defaults_to_incorrect():
    assert parse_verdict("... VERDICT: correct") == "correct"
    assert parse_verdict("VERDICT: correct\nwait, no.\nVERDICT: **incorrect**") == "incorrect"
    assert parse_verdict("looks fine to me") == "incorrect"


class CountingBackend:
    name = "fake"
    tokenizer = None
    info = None

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        return [
            [
                Generation(text=f"{p.token_ids}-{len(self.calls)}", token_ids=[1], finish_reason="stop")
                for _ in range(params.n)
            ]
            for p in prompts
        ]


def test_greedy_cache_serves_repeats_and_never_caches_samples():
    import torch

    raw = CountingBackend()
    cache = GreedyCache(raw)
    greedy = SamplingParams(max_new_tokens=8)
    a, b = PromptInput((1, 2)), PromptInput((3,))
    with_memory = PromptInput((1, 2), soft_prompt=torch.ones(2, 4))
    first = cache.generate([a, b], greedy)
    again = cache.generate([b, with_memory, a], greedy)  # b, a cached; the memory prompt is new
    assert raw.calls == [2, 1]
    assert again[0][0].text == first[1][0].text and again[2][0].text == first[0][0].text
    assert again[1][0].text != first[0][0].text  # a soft prompt is part of the key
    cache.generate([a], SamplingParams(max_new_tokens=9))  # another budget: another generation
    cache.generate([a], SamplingParams(max_new_tokens=8, temperature=0.8))  # sampled: never cached
    assert raw.calls == [2, 1, 1, 1] and (cache.hits, cache.misses) == (2, 4)
    again[0][0].text = "mutated"  # callers get copies
    assert cache.generate([b], greedy)[0][0].text == first[1][0].text


def test_greedy_cache_keeps_no_memory_answers_and_takes_back_recorded_ones():
    import torch

    raw = CountingBackend()
    cache = GreedyCache(raw, size=2)
    greedy = SamplingParams(max_new_tokens=8)
    a, b = PromptInput((1, 2)), PromptInput((3,))
    with_memory = PromptInput((1, 2), soft_prompt=torch.ones(2, 4))
    cache.generate([a, b], greedy)
    cache.generate([with_memory], greedy)
    cache.generate([with_memory], greedy)  # a memory's answer is not kept: asked again, made again
    assert raw.calls == [2, 1, 1]
    cache.generate([a, b], greedy)  # and it pushed no zero-shot answer out of the (2-entry) cache
    assert raw.calls == [2, 1, 1] and cache.hits == 2
    # a recorded answer put back is served as it was recorded, without a backend call
    recorded = Generation(text="recorded", token_ids=[7, 8], finish_reason="stop")
    c = PromptInput((9, 9))
    cache.put(c, greedy, recorded)
    [[served]] = cache.generate([c], greedy)
    assert raw.calls == [2, 1, 1] and (served.text, served.token_ids, served.finish_reason) == (
        "recorded",
        [7, 8],
        "stop",
    )
    with pytest.raises(ValueError, match="only greedy"):
        cache.put(c, SamplingParams(max_new_tokens=8, temperature=0.7), recorded)


# ---- the online protocol on the real tiny model -------------------------------------------


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_every_method_runs_the_online_protocol(tiny_loaded, tiny_backend, tmp_path):
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream

    cfg = tiny_config()
    problems = load_problems("gsm8k", limit=2, seed=17)
    methods = ["zero_shot", "verifier_at_2", "icl", "reasoning_bank", "elm_input", "elm_kv"]
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    result = run_stream(
        problems, methods, cfg, tmp_path, dataset="gsm8k", seed=17, runtime=runtime, progress=False, batch_size=2
    )
    records = RecordLog(tmp_path / "records.jsonl").read()
    assert sorted((r["method"], r["index"]) for r in records) == sorted((m, i) for m in methods for i in (0, 1))
    by = {(r["method"], r["index"]): r for r in records}
    for m in methods:
        assert by[(m, 0)]["question_id"] == problems[0].id and by[(m, 1)]["gold"] == problems[1].answer
        assert set(by[(m, 0)]["timings"]) == {"answer", "learn"}
    # memoryless methods keep no pool; every other method stores one entry per question
    assert by[("zero_shot", 1)]["pool_size"] == 0 and by[("verifier_at_2", 1)]["pool_size"] == 0
    for m in ("icl", "reasoning_bank", "elm_input", "elm_kv"):
        assert (by[(m, 0)]["pool_size"], by[(m, 1)]["pool_size"]) == (1, 2), m
        assert by[(m, 1)]["pool_bytes"] > 0
    # text pools retrieve the first question for the second one
    for m in ("icl", "reasoning_bank"):
        assert by[(m, 0)]["route"] == "zero_shot" and by[(m, 1)]["route"] == "context"
        assert by[(m, 1)]["memory_id"] == problems[0].id and -1.0 <= by[(m, 1)]["similarity"] <= 1.0
    assert by[("reasoning_bank", 0)]["extra"]["self_judgement"] in ("correct", "incorrect")
    # ELM's zero-shot candidate is the zero_shot method's generation, served from the shared cache
    assert by[("elm_input", 0)]["shared_generations"] == 1
    assert by[("elm_input", 0)]["candidates"][0]["answer"] == by[("zero_shot", 0)]["answer"]
    assert by[("elm_input", 0)]["extra"]["learn_job"]["status"] == "done"
    assert (
        by[("verifier_at_2", 0)]["route"] in ("agree", "verifier") and len(by[("verifier_at_2", 0)]["candidates"]) == 2
    )
    # the files a run leaves
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == methods and summary["icl"]["n"] == 2 and summary["elm_kv"]["pool_size"] == 2
    assert result.table.startswith("| method |") and "| reasoning_bank | 2 |" in result.table
    for name in ("accuracy_over_stream.png", "routes.png", "pool_growth.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    # the run names the machine its numbers come from
    [machine] = json.loads((tmp_path / "run.json").read_text())["machines"]
    assert machine["cpu"] and machine["dtype"] in ("float32", "bfloat16") and machine["num_threads"] >= 1
    # a finished run re-run does nothing and loads nothing; another config is refused
    again = run_stream(problems, methods, cfg, tmp_path, dataset="gsm8k", seed=17, progress=False, plots=False)
    assert again.summary == result.summary
    assert json.loads((tmp_path / "run.json").read_text())["machines"] == [machine]  # same machine: listed once
    with pytest.raises(
        ConfigError, match=r"holds another run \(its config differs: at config.training.steps the run has 1, now 2\)"
    ):
        run_stream(problems, methods, tiny_config(training={"steps": 2}), tmp_path, dataset="gsm8k", seed=17)


@pytest.mark.model
def test_a_killed_stream_resumes_with_its_pool_intact(tiny_loaded, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "elm_memory.cli",
        "stream",
        "--dataset",
        "gsm8k",
        "--limit",
        "3",
        "--seed",
        "5",
        "--preset",
        "cpu-tiny",
        "--set",
        "generation.max_new_tokens=12",
        "--method",
        "elm_input",
        "--out",
        str(out),
        "--no-plots",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = out / "records.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if records.exists() and len(RecordLog(records).read()) >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = RecordLog(records).read()
    assert 1 <= len(before) < 3
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    after = RecordLog(records).read()
    assert [r["index"] for r in after] == [0, 1, 2]  # nothing run twice, nothing lost
    assert after[: len(before)] == before
    assert after[-1]["pool_size"] == 3  # one memory per question, no duplicate from the killed job
    assert json.loads((out / "summary.json").read_text())["elm_input"]["n"] == 3


@pytest.mark.model
def test_a_resumed_stream_gives_elm_the_zero_shot_answers_it_recorded(tiny_loaded, tiny_backend, tmp_path):
    """zero_shot recorded in one process, elm_input run in the next: ELM's zero-shot candidate is still
    the recorded answer, served from the cache (not made again in another batch)."""
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream

    cfg = tiny_config()
    problems = load_problems("gsm8k", limit=3, seed=17)

    def run(methods):  # each call a fresh runtime, as in a restarted process: a fresh (empty) cache
        runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
        run_stream(
            problems, methods, cfg, tmp_path, dataset="gsm8k", seed=17, progress=False, plots=False, runtime=runtime
        )
        return runtime

    run(["zero_shot"])
    zero = RecordLog(tmp_path / "records.jsonl").read()
    assert all(len(r["extra"]["generation"]["token_ids"]) >= 1 for r in zero)
    runtime = run(["zero_shot", "elm_input"])
    records = RecordLog(tmp_path / "records.jsonl").read()
    assert records[:3] == zero  # zero_shot was not run again
    elm = [r for r in records if r["method"] == "elm_input"]
    assert [r["shared_generations"] for r in elm] == [1, 1, 1]
    for z, e in zip(zero, elm, strict=True):
        assert e["candidates"][0] == z["candidates"][0]
    assert runtime.greedy_cache.misses == sum(1 for r in elm if r["memory_id"])  # only the memories' answers


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_a_question_whose_record_was_lost_is_answered_again_without_its_own_memory(tiny_loaded, tiny_backend, tmp_path):
    """Stopped after question 2's memory was stored but before its record was written: the resumed
    run removes that memory and its job, answers question 2 from the pool it had (not from its own
    memory) and learns the memory again."""
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.jobs.queue import JobQueue

    # SmolLM2 never answers, so every memory is no_consensus: let it be retrieved all the same
    cfg = tiny_config(retrieval={"skip_no_consensus": False})
    problems = load_problems("gsm8k", limit=2, seed=17)

    def run():
        runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
        run_stream(
            problems,
            ["elm_input"],
            cfg,
            tmp_path,
            dataset="gsm8k",
            seed=17,
            progress=False,
            plots=False,
            runtime=runtime,
        )

    run()
    log_path = tmp_path / "records.jsonl"
    first, second = RecordLog(log_path).read()
    assert second["memory_id"] == first["extra"]["learn_job"]["memory_id"]  # question 2 used question 1's memory
    own = second["extra"]["learn_job"]["memory_id"]
    assert own and own != second["memory_id"]
    log_path.write_text(json.dumps(first) + "\n")  # the stop: question 2's memory stored, its record lost

    resumed_at = time.time()
    run()
    again = RecordLog(log_path).read()
    assert again[0] == first
    assert again[1]["memory_id"] == second["memory_id"]  # not its own memory, which would score 1.00
    assert again[1]["similarity"] == pytest.approx(second["similarity"])
    assert again[1]["extra"]["learn_job"]["memory_id"] == own  # learned again (same job id), not a no-op
    with JobQueue(tmp_path / "store" / "learner-elm_input.sqlite3") as queue:
        assert queue.get(own).finished_at > resumed_at
    assert again[1]["pool_size"] == 2


def test_pools_need_a_store_and_the_runtime_its_run_directory(tmp_path):
    # refused by name before any model is loaded
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.offline import run_offline
    from elm_memory.eval.online import run_stream

    problems = load_problems("gsm8k", limit=1, seed=17)
    no_store = tiny_config(store={"kind": "none"})
    with pytest.raises(ConfigError, match="elm_input learns memories into a store, but store.kind is 'none'"):
        run_stream(problems, ["elm_input"], no_store, tmp_path / "online", progress=False)
    with pytest.raises(ConfigError, match="store.kind is 'none'"):
        run_offline(problems, no_store, tmp_path / "offline", progress=False)
    cfg = tiny_config()
    with pytest.raises(ConfigError, match="not in the run directory"):
        run_stream(problems, ["zero_shot"], cfg, tmp_path / "a", runtime=EvalRuntime(cfg, tmp_path / "b"))


# ---- the offline protocol ---------------------------------------------------------------------


@pytest.mark.model
def test_offline_learning_prints_a_line_per_training_step(tiny_loaded, tiny_backend, tmp_path, capsys, monkeypatch):
    """In a log, a batch of memories that learns for many minutes still shows each step."""
    from elm_memory.eval import progress
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.offline import run_offline

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    cfg = tiny_config(training={"steps": 2})
    problems = load_problems("gsm8k", limit=1, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    run_offline(problems, cfg, tmp_path, dataset="gsm8k", train=1, runtime=runtime, plots=False)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[progress] learning memory 1/1")]
    assert [x.split(" · ")[0] for x in lines] == [
        "[progress] learning memory 1/1 (0 done)",
        "[progress] learning memory 1/1 (0 done), step 1/2",
        "[progress] learning memory 1/1 (0 done), step 2/2",
    ]


@pytest.mark.model
def test_an_online_run_in_a_log_says_its_time_left(tiny_loaded, tiny_backend, tmp_path, capsys, monkeypatch):
    """In a log (nohup), an online run of hours says how far it is and how long is left, once per interval."""
    from elm_memory.eval import progress
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    cfg = tiny_config()
    problems = load_problems("gsm8k", limit=3, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    run_stream(problems, ["zero_shot"], cfg, tmp_path, dataset="gsm8k", seed=17, runtime=runtime, plots=False)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[progress]")]
    assert len(lines) == 1  # the first step's; the next come STREAM_LINE_SECONDS apart
    assert lines[0].startswith("[progress] zero_shot · questions 1-3/3 · 1/3 steps · ")
    assert lines[0].endswith(" left") and "unknown" not in lines[0]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_offline_protocol_and_transfer(tiny_loaded, tiny_backend, tmp_path):
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.offline import run_offline

    cfg = tiny_config()
    problems = load_problems("gsm8k", limit=3, seed=17)
    out = tmp_path / "gsm8k"
    runtime = EvalRuntime(cfg, out, loaded=tiny_loaded, backend=tiny_backend)
    result = run_offline(problems, cfg, out, dataset="gsm8k", seed=17, train=2, runtime=runtime, progress=False)
    mems = RecordLog(out / "memories.jsonl").read()
    evals = RecordLog(out / "evals.jsonl").read()
    assert [m["question_id"] for m in mems] == [p.id for p in problems[:2]]
    assert len(evals) == 2 * 3 and len(RecordLog(out / "zero_shot.jsonl").read()) == 3
    s = result.summary
    assert s["n_memories"] == 2 and s["n_questions"] == 3
    per_memory: dict[str, list[bool]] = {}
    for e in evals:
        per_memory.setdefault(e["source_question_id"], []).append(e["correct"])
    assert s["best_memory"]["accuracy"] == max(sum(v) / 3 for v in per_memory.values())
    assert "| zero-shot accuracy (%) |" in result.table
    assert (out / "memory_deltas.png").read_bytes()[:8] == PNG
    # transfer: the gsm8k pool evaluated on two math500 questions
    other = load_problems("math500", limit=2, seed=17)
    t = run_offline(
        other,
        cfg,
        tmp_path / "transfer",
        dataset="math500",
        seed=17,
        memories_from=out,
        runtime=EvalRuntime(cfg, tmp_path / "transfer", loaded=tiny_loaded, backend=tiny_backend),
        progress=False,
        plots=False,
    )
    assert t.summary["n_memories"] == 2 and t.summary["n_questions"] == 2
    assert {e["question_id"] for e in RecordLog(tmp_path / "transfer" / "evals.jsonl").read()} == {p.id for p in other}
    assert not (tmp_path / "transfer" / "store").exists()  # the pool is read where it is
    with pytest.raises(ConfigError, match="not an offline run directory"):
        run_offline(other, cfg, tmp_path / "x", memories_from=tmp_path)


@pytest.mark.model
def test_the_evaluation_example_runs(tiny_loaded, tmp_path):
    script = Path(__file__).resolve().parents[1] / "examples" / "evaluate.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--tiny", "--limit", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| elm_input | 2 |" in done.stdout
    assert (tmp_path / "elm-runs" / "example-cpu-tiny-2" / "routes.png").read_bytes()[:8] == PNG


def test_a_resume_on_another_machine_adds_it_to_the_manifest(tmp_path):
    from elm_memory.eval.records import check_manifest

    fields = ("dataset", "config")
    base = {"dataset": "d", "config": {"x": 1}, "methods": ["zero_shot"]}
    check_manifest(tmp_path, {**base, "machines": [{"cpu": "A"}]}, fields)
    check_manifest(tmp_path, {**base, "machines": [{"cpu": "A"}]}, fields)
    merged = check_manifest(tmp_path, {**base, "methods": ["elm_input"], "machines": [{"cpu": "B"}]}, fields)
    assert merged["machines"] == [{"cpu": "A"}, {"cpu": "B"}]
    assert merged["methods"] == ["zero_shot", "elm_input"]
    assert json.loads((tmp_path / "run.json").read_text()) == merged
    # the code that ran is kept the same way: a resume under another commit adds it, so mixed code shows
    code = check_manifest(tmp_path, {**base, "code_versions": [{"commit": "abc"}]}, fields)
    assert code["code_versions"] == [{"commit": "abc"}] and code["machines"] == merged["machines"]
    again = check_manifest(tmp_path, {**base, "code_versions": [{"commit": "def"}]}, fields)
    assert again["code_versions"] == [{"commit": "abc"}, {"commit": "def"}]
    with pytest.raises(ConfigError, match="holds another run"):  # the machine never makes it another run
        check_manifest(tmp_path, {**base, "config": {"x": 2}, "machines": [{"cpu": "A"}]}, fields)


def test_a_run_written_before_a_setting_existed_resumes_while_the_setting_keeps_its_default(tmp_path):
    from elm_memory.eval.records import check_manifest

    fields = ("dataset", "config")
    defaults = {"config": {"memory": {"k": 20, "kind": "soft_prompt"}, "new_section": {"a": 1}}}
    (tmp_path / "run.json").write_text(json.dumps({"dataset": "d", "config": {"memory": {"k": 20}}, "methods": []}))
    now = {"dataset": "d", "config": {"memory": {"k": 20, "kind": "soft_prompt"}, "new_section": {"a": 1}}}
    merged = check_manifest(tmp_path, {**now, "methods": ["elm_input"]}, fields, defaults)
    assert merged["config"] == now["config"]  # written back filled, so the next resume compares as is
    with pytest.raises(ConfigError, match="its config differs"):  # a new setting away from its default
        changed = {"memory": {"k": 20, "kind": "lora"}, "new_section": {"a": 1}}
        check_manifest(tmp_path, {**now, "config": changed, "methods": []}, fields, defaults)
    (tmp_path / "run.json").write_text(json.dumps({"dataset": "d", "config": {"memory": {"k": 10}}, "methods": []}))
    with pytest.raises(ConfigError, match="its config differs"):  # an old setting that differs still does
        check_manifest(tmp_path, {**now, "methods": []}, fields, defaults)


def test_a_run_written_before_the_stream_settings_moved_into_tuning_resumes_under_the_new_spelling(tmp_path):
    from elm_memory.config import ELMConfig
    from elm_memory.config.stream_tuning import TUNING_KEYS
    from elm_memory.eval.records import check_manifest, config_defaults

    now = ELMConfig.load(preset="cpu-amortized", overrides={"stream": {"tuning": {"gate_test": "non_inferiority"}}})
    old_config = now.model_dump(mode="json")
    tuned = old_config["stream"].pop("tuning")
    # as run.json spelled it before stream.tuning; settings added since were never flat and are absent
    old_config["stream"].update({k: v for k, v in tuned.items() if k in TUNING_KEYS})
    (tmp_path / "run.json").write_text(json.dumps({"dataset": "d", "config": old_config, "methods": []}))
    manifest = {"dataset": "d", "config": now.model_dump(mode="json"), "methods": ["elm_amortized"]}
    merged = check_manifest(tmp_path, manifest, ("dataset", "config"), config_defaults())
    assert merged["config"]["stream"]["tuning"]["gate_test"] == "non_inferiority"
    assert merged["config"]["stream"]["tuning"]["gate_read_share"] == 1.0  # absent from the old run: its default
    other = ELMConfig.load(preset="cpu-amortized").model_dump(mode="json")  # another gate test: another run
    with pytest.raises(ConfigError, match=r"config\.stream\.tuning\.gate_test"):
        (tmp_path / "run.json").write_text(json.dumps({"dataset": "d", "config": old_config, "methods": []}))
        check_manifest(tmp_path, {**manifest, "config": other}, ("dataset", "config"), config_defaults())


def test_the_resume_defaults_are_the_config_schema_defaults():
    from elm_memory.config import ELMConfig
    from elm_memory.eval.records import config_defaults

    assert config_defaults()["config"]["memory"]["kind"] == ELMConfig().memory.kind == "soft_prompt"


def test_an_interrupted_run_leaves_its_learning_queued_instead_of_running_it(tiny_loaded, tiny_backend, tmp_path):
    """Ctrl-C while question 1's memory is learned: the run stops at once (its close does not run the
    interrupted job again, as it did, for tens of seconds on a CPU); the job waits as pending and the
    resumed run answers the question and learns its memory."""
    from elm_memory.elm import ELM
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.jobs.queue import JobQueue

    cfg = tiny_config()
    problems = load_problems("gsm8k", limit=1, seed=17)
    calls = []
    real = ELM.learn_from_job

    def interrupted_once(self, job, *args, **kwargs):
        calls.append(job.job_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, job, *args, **kwargs)

    def run():
        runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
        run_stream(
            problems, ["elm_input"], cfg, tmp_path, dataset="gsm8k", progress=False, plots=False, runtime=runtime
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ELM, "learn_from_job", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            run()
    assert len(calls) == 1  # not run again on the way out
    with JobQueue(tmp_path / "store" / "learner-elm_input.sqlite3") as queue:
        assert queue.get(calls[0]).state == "pending"
    assert not (tmp_path / "records.jsonl").exists() or RecordLog(tmp_path / "records.jsonl").read() == []
    run()
    [record] = RecordLog(tmp_path / "records.jsonl").read()
    assert record["extra"]["learn_job"]["status"] == "done" and record["pool_size"] == 1


def test_records_and_walkthrough_show_how_many_samples_the_verifier_drew():
    """A sampling verifier's cost per question: the ELM method records the count of samples scored (a tie's
    extra draw included) and the demo's candidates line shows it; without one, neither does."""
    from types import SimpleNamespace

    from elm_memory.eval.methods.elm_method import ELMMethod
    from elm_memory.eval.walkthrough import Walkthrough

    sampled = SimpleNamespace(gate=None, verifier_sample_answers=["7", "3", "9", "9"] + ["7"] * 8)
    assert ELMMethod._extra(sampled) == {"verifier_samples": 12}
    assert ELMMethod._extra(SimpleNamespace(gate={"decision": "used"}, verifier_sample_answers=None)) == {
        "gate": {"decision": "used"}
    }
    record = {
        "index": 0,
        "question_id": "q0",
        "question": "What is 3 + 4?",
        "gold": "7",
        "answer": "7",
        "correct": True,
        "route": "verifier",
        "memory_id": None,
        "timings": {},
        "candidates": [
            {"kind": "zero_shot", "answer": "3", "score": 1 / 12, "correct": False},
            {"kind": "memory", "answer": "7", "score": 9 / 12, "correct": True},
        ],
        "extra": {"verifier_samples": 12},
    }
    zero = {**record, "answer": "3", "correct": False, "route": "zero_shot", "candidates": [], "extra": {}}
    walk = Walkthrough(1, lambda _: None)
    line = next(x for x in walk.describe(zero, record).splitlines() if "candidates:" in x)
    assert line.endswith("(score 0.750)  (12 samples)")
    del record["extra"]["verifier_samples"]
    line = next(x for x in walk.describe(zero, record).splitlines() if "candidates:" in x)
    assert "samples" not in line


def test_the_walkthrough_waits_for_every_method_and_shows_self_consistencys_votes():
    from elm_memory.eval.walkthrough import Walkthrough

    base = {"index": 0, "question_id": "q0", "question": "What is 3+4?", "gold": "7", "timings": {}, "candidates": []}
    zero = {**base, "method": "zero_shot", "answer": "3", "correct": False, "route": "zero_shot", "extra": {}}
    vote = {**base, "method": "self_consistency", "answer": "7", "correct": True, "route": "vote",
            "extra": {"votes": [["3", 1], ["7", 3]]}}  # fmt: skip
    elm = {**base, "method": "elm_input", "answer": "3", "correct": False, "route": "agree", "memory_id": None,
           "extra": {}}  # fmt: skip
    printed: list[str] = []
    walk = Walkthrough(1, printed.append, others=["self_consistency"])
    walk(zero)
    walk(elm)
    assert printed == []  # self-consistency's record is not in yet
    walk(vote)
    [text] = printed
    lines = text.splitlines()
    sc = next(x for x in lines if x.strip().startswith("self-cons."))
    assert "7 ✓" in sc and "votes 3 x1, 7 x3" in sc
    assert lines.index(sc) < next(i for i, x in enumerate(lines) if x.strip().startswith("ELM"))


def _walked(route: str, samples: list[str], vote: bool = False, **extra: object) -> str:
    """What the demo prints for one question: greedy says 3, the memory 7, gold 7."""
    from elm_memory.eval.paired import ReplaySettings
    from elm_memory.eval.walkthrough import Walkthrough

    base = {"index": 0, "question_id": "q0", "question": "What is 3+4?", "gold": "7", "timings": {}}
    zero = {**base, "method": "zero_shot", "answer": "3", "correct": False, "route": "zero_shot", "candidates": []}
    elm = {**base, "method": "elm_input", "answer": "7", "correct": True, "route": route, "memory_id": "m1",
           "similarity": 0.9,
           "candidates": [{"kind": "zero_shot", "answer": "3"}, {"kind": "memory", "answer": "7"}],
           "extra": {"verifier_sample_answers": samples, **extra}}  # fmt: skip
    printed: list[str] = []
    walk = Walkthrough(1, printed.append, paired=ReplaySettings(replay=True, prefer_answered=True, k=4, vote=vote))
    walk(zero)
    walk(elm)
    [text] = printed
    return text


def test_the_walkthrough_shows_the_paired_rows_from_elms_own_record():
    from elm_memory.eval.walkthrough import Walkthrough

    text = _walked("verifier", ["7", "7", "3", "9"], untrained_twin={"memory_id": "m1", "answer": "9"})
    lines = text.splitlines()
    sc = next(x for x in lines if x.strip().startswith("self-cons."))
    assert "3 ✗" in sc and "votes 3 x2, 7 x2, 9 x1" in sc  # a 2-2 tie goes to greedy
    untrained = next(x for x in lines if x.strip().startswith("untrained"))
    # the twin's 9 agrees with one sample, greedy's 3 with one: a tie, so ELM with it keeps greedy's 3
    assert "9 ✗" in untrained and "ELM with it: 3 ✗" in untrained
    assert next(x for x in lines if x.strip().startswith("ELM")).endswith("route verifier")
    assert Walkthrough(1, lambda _: None).paired is None


def test_the_walkthrough_says_a_voted_answer_is_self_consistencys_votes_and_the_memorys():
    """verifier.route=vote (the cpu-demo preset): the ELM line names the memory's vote beside the samples'."""
    text = _walked("vote", ["7", "3", "9", "8"], vote=True)
    line = next(x for x in text.splitlines() if x.strip().startswith("ELM"))
    assert "7 ✓" in line and line.endswith("route vote (the votes above and the memory's 7)")
