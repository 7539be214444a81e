"""The `elm` command line, run as a real subprocess (exit codes, stderr, JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def elm(*args: str, timeout: float = 600, cwd: object = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def test_help_lists_the_commands():
    r = elm("--help")
    assert r.returncode == 0
    for command in ("solve", "demo", "model", "config"):
        assert command in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["solve", "   ", "--preset", "cpu-tiny"], "error: question is empty"),
        (["solve", "hi", "--preset", "nope"], "error: unknown preset 'nope'"),
        (["solve", "hi", "--set", "training.stepz=3"], "error: invalid config: unknown config key 'training.stepz'"),
        (["solve", "hi", "--config", "/nonexistent.yaml"], "error: cannot read config file"),
        (["solve", "hi", "--set", "model.name_or_path=packaged:nope"], "error: unknown packaged model 'packaged:nope'"),
        (["solve", "hi", "--set", "model.name_or_path=/tmp/definitely-missing.gguf"], "error: GGUF file not found"),
        (
            ["solve", "hi", "--preset", "cpu-tiny", "--backend", "nope"],
            "error: invalid config: backend.name: unknown backend 'nope'",
        ),
        # cpu-demo votes on the consistency verifier's samples: another verifier needs the verify route too
        (["solve", "hi", "--set", "verifier.name=self_certainty", "--preset", "cpu-demo"], "error: invalid config"),
    ],
)
def test_bad_input_is_one_line_no_traceback(args, message):
    r = elm(*args)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(message), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_solve_says_when_it_reused_the_memory_a_repeated_question_has(monkeypatch):
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import elm_memory.elm
    from elm_memory.cli import app

    memory_id = "ab12" * 16
    job = {"job_id": memory_id, "status": "done", "memory_id": memory_id, "duplicate": True, "reused": True}

    class AnsweredBefore:  # the facade, with what a second ask of a learned question returns
        def __init__(self, config):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def answer(self, question, *, namespace, learn=True):
            return SimpleNamespace(
                response="\\boxed{5}",
                answer="5",
                route="agree",
                memory_id=memory_id,
                similarity=1.0,
                timings={"total": 0.1},
                warnings=[],
                learn_job=job,
            )

    monkeypatch.setattr(elm_memory.elm, "ELM", AnsweredBefore)
    res = CliRunner().invoke(app, ["solve", "What is 2 + 3?", "--preset", "cpu-tiny"])
    assert res.exit_code == 0, res.output
    assert "(route: agree, memory ab12ab12ab12 (sim 1.000)" in res.stdout
    assert res.stderr.strip() == (
        "note: this question was learned before: reused its memory ab12ab12ab12, no new memory learned"
    )
    job["reused"] = False
    assert "note:" not in CliRunner().invoke(app, ["solve", "What is 2 + 3?", "--preset", "cpu-tiny"]).stderr


def test_solve_says_how_a_stream_memory_answered_and_what_it_cost(monkeypatch):
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import elm_memory.elm
    from elm_memory.cli import app

    turn = {"mode": "memory", "serving": "amortized", "gate": "serving", "probe": False, "version": 12, "tokens": 87}
    answered = SimpleNamespace(  # what a served amortized stream memory returns when it answers alone
        response="\\boxed{5}",
        answer="5",
        route="stream",
        memory_id=None,
        similarity=None,
        timings={"total": 0.1},
        warnings=[],
        learn_job=None,
        stream_turn=turn,
    )
    facade = type(
        "Facade",
        (),
        {
            "__init__": lambda self, config: None,
            "__enter__": lambda self: self,
            "__exit__": lambda self, *exc: None,
            "answer": lambda self, question, *, namespace, learn=True: answered,
        },
    )
    monkeypatch.setattr(elm_memory.elm, "ELM", facade)
    res = CliRunner().invoke(app, ["solve", "What is 2 + 3?", "--preset", "cpu-tiny"])
    assert res.exit_code == 0, res.output
    assert "(route: stream, " in res.stdout
    assert "stream memory: memory, gate serving, version 12, 87 tokens generated" in res.stdout


def test_swapping_the_demos_verifier_names_the_route_to_set():
    r = elm("config", "show", "--preset", "cpu-demo", "--set", "verifier.name=self_certainty")
    assert r.returncode == 2 and "set verifier.route=verify as well" in r.stderr, r.stderr
    r = elm(
        "config",
        "show",
        "--preset",
        "cpu-demo",
        "--set",
        "verifier.name=self_certainty",
        "--set",
        "verifier.route=verify",
    )
    assert r.returncode == 0, r.stderr
    assert "route: verify" in r.stdout and "name: self_certainty" in r.stdout


def test_config_show_prints_effective_yaml():
    import yaml

    r = elm("config", "show", "--preset", "cpu-tiny", "--set", "training.steps=4")
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["model"]["name_or_path"] == "packaged:smollm2-135m" and data["training"]["steps"] == 4
    assert "cpu-demo" in elm("config", "presets").stdout


def test_model_list_shows_both_packaged_models():
    r = elm("model", "list")
    assert r.returncode == 0
    assert "packaged:qwen2.5-coder-0.5b" in r.stdout and "packaged:smollm2-135m" in r.stdout


@pytest.mark.model
def test_solve_json_on_the_real_tiny_model():
    r = elm("solve", "What is 2+3?", "--preset", "cpu-tiny", "--json", "--namespace", "t")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"answer", "response", "route", "memory_id", "timings"} <= out.keys()
    assert out["route"] == "zero_shot" and out["memory_id"] is None
    assert isinstance(out["response"], str) and out["response"]
    assert out["timings"]["total"] > 0


@pytest.mark.model
def test_over_long_question_is_refused_by_the_cli():
    r = elm("solve", "word " * 9000, "--preset", "cpu-tiny")
    assert r.returncode == 2 and "question too long" in r.stderr


@pytest.mark.model
def test_demo_shows_every_method_per_question_on_cpu_tiny(tmp_path):
    out = tmp_path / "demo"  # given relative: the run, its memory pool included, lives under the working directory
    args = [
        "demo",
        "--preset",
        "cpu-tiny",
        "--limit",
        "2",
        "--out",
        "demo",
        "--set",
        "training.steps=1",
        "--set",
        "training.num_generations=2",
        "--set",
        "retrieval.skip_no_consensus=false",
        "--set",
        "generation.max_new_tokens=24",
        "--set",
        "training.max_completion_length=24",
    ]
    r = elm(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "store" / "chroma").is_dir() and any((out / "store" / "blobs").rglob("*"))  # not under $ELM_HOME
    first, second = r.stderr.split("[2/2] ")[0].split("[1/2] ")[1], r.stderr.split("[2/2] ")[1]
    assert "zero-shot" in first and "route zero_shot" in first and "no memory yet (empty pool)" in first
    # self-consistency read from ELM's own record (no memory yet: the evaluation drew ELM's k samples)
    assert "self-cons." in first and "votes " in first
    # the second question retrieves the first one's memory, says where it came from, shows both candidates
    assert "memory " in second and "from Q1 (synth" in second and "similarity 0." in second
    assert "candidates: zero-shot" in second and "|  memory" in second
    assert "untrained " in second and "(the same memory before training" in second
    # answered and learned side by side (learner.overlap_answering): the timing line says so
    assert "(memory learned alongside), then learning" in second
    # one closing table (self-consistency and ELM untrained read from ELM's records), the plots, then `elm report`
    assert all(f"| {m} " in r.stdout for m in ("zero_shot", "self_consistency", "elm_input"))
    assert "Paired on elm_input's own generations" not in r.stdout and "Head to head" not in r.stdout
    assert "plot: " in r.stdout and f"elm report {out.resolve()}" in r.stdout
    full = elm("report", "demo", "--no-plots", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    assert "Paired on elm_input's own generations" in full.stdout and "| self_consistency |" in full.stdout
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted((rec["method"], rec["index"]) for rec in records) == [
        ("elm_input", 0),
        ("elm_input", 1),
        ("zero_shot", 0),
        ("zero_shot", 1),
    ]
    assert [r for r in records if r["method"] == "elm_input"][-1]["extra"]["gate"]["decision"] in {"used", "empty_pool"}
    again = elm(*args, cwd=tmp_path)  # a finished run is printed again, nothing recomputed
    assert again.returncode == 0 and "[1/2]" not in again.stderr and again.stdout == r.stdout


@pytest.mark.model
def test_demo_amortized_shows_each_rows_tokens_the_mode_and_the_gate_on_cpu_tiny(tmp_path):
    sets = {
        "stream.mode": "stream",
        "stream.serving": "amortized",  # learns from zero-shot's samples by sft: not set, it follows serving
        "verifier.name": "consistency",
        "verifier.consistency_samples": "2",
        "generation.max_new_tokens": "24",
        "training.max_completion_length": "24",
    }
    args = ["demo", "--amortized", "--preset", "cpu-tiny", "--limit", "2"]
    r = elm(*args, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "elm-runs" / "demo-amortized-synth-arith-2"  # the default run directory
    assert (out / "records.jsonl").is_file()
    first, second = r.stderr.split("[2/2] ")[0].split("[1/2] ")[1], r.stderr.split("[2/2] ")[1]
    for question in (first, second):
        assert "zero-shot" in question and "self-cons." in question and "votes " in question
        assert "memory " in question and "the stream memory's greedy answer" in question
        # warm-up: the vote answers, ELM's tokens beside self-consistency's, the gate's state and reading
        assert "mode self_consistency" in question and question.count(" tokens") == 4
        assert "gate warmup" in question and "its reading: " in question
    table = r.stdout
    assert all(f"| {m} |" in table for m in ("zero_shot", "self_consistency", "stream_greedy", "elm_amortized"))
    assert "tokens / question" in table and "The gate stayed in warmup" in table
    assert f"plot: {(out / 'amortized.png').resolve()}" in table
    assert f"elm report {out.resolve()}" in table
    assert (out / "amortized.png").is_file()
    full = elm("report", str(out), "--no-plots")
    assert full.returncode == 0 and "Amortized stream memory" in full.stdout


def test_a_stream_records_line_names_the_memory_its_answer_had():
    """`elm stream`'s line per record: a retrieved memory, the stream memory's version and gate, or none."""
    from elm_memory.cli.evaluate import _memory_used

    retrieved = {"memory_id": "dda63bef0123", "similarity": 0.8561}
    turn = {"mode": "memory", "gate": "serving", "version": 102, "tokens": 196}
    assert _memory_used(retrieved) == "memory dda63bef sim 0.86"
    assert _memory_used({"memory_id": None, "extra": {"amortized": {"turn": turn}}}) == (
        "stream memory v102, gate serving, 196 tokens"
    )
    untrained = {"extra": {"amortized": {"turn": {**turn, "version": None, "gate": "warmup"}}}}
    assert _memory_used(untrained) == "stream memory untrained, gate warmup, 196 tokens"
    assert _memory_used({"memory_id": None, "extra": {"stream": {"kind": "lora"}}}) == "stream memory"
    assert _memory_used({"memory_id": None, "extra": {}}) == "no memory"
