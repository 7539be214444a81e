"""Issue 36's evidence: seeded samples that repeat, records of what decided, the compute-matched
baselines (self_consistency, maj_at_k, elm_untrained), the sign test and the SC counterfactual."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError, RegistryError
from elm_memory.eval.counterfactual import self_consistency_counterfactual
from elm_memory.eval.methods.voting import majority_vote, vote_counts
from elm_memory.eval.significance import head_to_head, paired_outcomes, sign_test
from elm_memory.verifiers.seeding import sample_seed, sample_seeds

QUESTION = "What is 17 + 25? Think it through."
OTHER = "A train leaves at 3 pm at 60 km/h and another at 4 pm at 80 km/h. When does the second catch up?"


# ---- votes on hand-made samples ------------------------------------------------------------------


def test_self_consistency_vote_counts_greedy_once_and_breaks_ties_to_it():
    # greedy 5 + samples 7, 5, 7, 3: 7 and 5 have two votes each -> the tie goes to greedy
    assert majority_vote(["7", "5", "7", "3"], "5", with_greedy=True) == "5"
    # a clear sample majority beats greedy
    assert majority_vote(["7", "7", "7", "5"], "5", with_greedy=True) == "7"
    # greedy not among the tied: the answer drawn first of the tied ones
    assert majority_vote(["9", "7", "7", "9"], "5", with_greedy=True) == "9"
    # no boxed answer casts no vote: greedy's single vote wins over samples without answers
    assert majority_vote([None, None, "7", None], "5", with_greedy=True) == "5"
    assert majority_vote([None, None, None, None], None, with_greedy=True) is None
    # greedy without an answer: the samples decide
    assert majority_vote([None, "4", "4", "6"], None, with_greedy=True) == "4"
    # equivalent answers are one answer: 7 and 7.0 make two votes against greedy's 5
    assert majority_vote(["7", "7.0", "3", None], "5", with_greedy=True) == "7"


def test_majority_at_k_ignores_greedy_and_breaks_ties_to_the_first_drawn():
    assert majority_vote(["3", "7", "7", "3"], "7") == "3"  # 2-2 tie: 3 was drawn first; greedy ignored
    assert majority_vote(["3", "7", "7", "3"], "7", with_greedy=False) == "3"
    assert majority_vote([None, "8", "2", "2"]) == "2"
    assert majority_vote([None, None]) is None and majority_vote([]) is None
    assert vote_counts(["7", None, "7.0", "2"]) == [("7", 2, 0), ("2", 1, 3)]


# ---- sign test and head-to-head pooling ---------------------------------------------------------


def test_sign_test_is_the_exact_two_sided_binomial():
    assert sign_test(0, 0) == 1.0
    assert sign_test(8, 0) == pytest.approx(2 / 256)
    assert sign_test(0, 8) == pytest.approx(2 / 256)
    assert sign_test(6, 2) == pytest.approx(2 * (1 + 8 + 28) / 256)
    assert sign_test(3, 3) == 1.0  # capped at 1
    assert sign_test(24, 3) < 1e-4
    with pytest.raises(ValueError):
        sign_test(-1, 2)


def _rec(method, qid, correct, **extra):
    return {"method": method, "question_id": qid, "correct": correct, "index": 0, "gold": "7", **extra}


def test_pooled_outcomes_count_each_distinct_question_once():
    run_a = [_rec("elm_input", "q1", True), _rec("zero_shot", "q1", False), _rec("elm_input", "q2", True)]
    run_a += [_rec("zero_shot", "q2", True)]
    run_b = [_rec("elm_input", "q1", True), _rec("zero_shot", "q1", False)]  # q1 again, another seed
    run_b += [_rec("elm_input", "q3", False), _rec("zero_shot", "q3", True)]
    out = paired_outcomes([run_a, run_b], "elm_input", "zero_shot")
    assert out == {"questions": 3, "wins": 1, "losses": 1, "ties": 1, "p": 1.0}
    # a question won in one seed and lost in another nets to a tie
    run_c = [_rec("elm_input", "q1", False), _rec("zero_shot", "q1", True)]
    assert paired_outcomes([run_a[:2], run_c], "elm_input", "zero_shot")["ties"] == 1
    assert paired_outcomes([run_a], "elm_input", "maj_at_k") is None
    rows = head_to_head([run_a + [_rec("self_consistency", "q1", True)]])
    assert [(r["method"], r["baseline"]) for r in rows] == [
        ("elm_input", "zero_shot"),
        ("elm_input", "self_consistency"),
    ]


def test_the_counterfactual_votes_on_the_recorded_samples():
    def elm(qid, answer, correct, greedy, samples):
        extra = {} if samples is None else {"verifier_sample_answers": samples}
        cands = [{"kind": "zero_shot", "answer": greedy}, {"kind": "memory", "answer": answer}]
        return _rec("elm_input", qid, correct, answer=answer, candidates=cands, extra=extra)

    records = [
        elm("q1", "7", True, "5", ["7", "7", "7", "3"]),  # the vote also picks 7: same answer
        elm("q2", "7", True, "5", ["7", "5", "3", None]),  # vote ties 5-7 -> greedy 5 (wrong): a gain for ELM
        elm("q3", "5", False, "5", ["7", "7", "7", "5"]),  # vote picks 7 (right), ELM kept 5: a loss
        elm("q4", "7", True, "7", None),  # no samples: not judged
    ]
    cf = self_consistency_counterfactual(records, "elm_input")
    assert cf == {
        "method": "elm_input",
        "questions": 4,
        "with_samples": 3,
        "same_answer": 1,
        "vote_correct": 2,
        "elm_correct": 2,
        "gains": 1,
        "losses": 1,
    }
    assert self_consistency_counterfactual(records[3:], "elm_input") is None


# ---- seeds -------------------------------------------------------------------------------------


def test_sample_seeds_name_run_question_and_index():
    seeds = sample_seeds(42, QUESTION, 6)
    assert len(set(seeds)) == 6 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seeds(42, QUESTION, 2, start=4) == seeds[4:]
    assert sample_seed(43, QUESTION, 0) != seeds[0] and sample_seed(42, OTHER, 0) != seeds[0]
    assert sample_seeds(None, QUESTION, 3) == [None, None, None]


@pytest.mark.model
def test_seeded_samples_repeat_across_batch_layouts_and_sample_counts(tiny_backend):
    """Sample j of a question is one draw: alone, among another question's rows, with k = 2 or 4, and with
    the backend's lookup drafts on (whose drafts depend on what it generated before)."""
    from elm_memory.backends.hf import HFBackend
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    def tokens(backend, rows, params):
        return [gens[0].token_ids for gens in backend.generate(rows, params)]

    v = ConsistencyVerifier(tiny_backend, samples=4, max_new_tokens=16, seed=42)
    rows, params = v.sample_request(QUESTION)
    alone = tokens(tiny_backend, rows, params)
    assert len({tuple(t) for t in alone}) > 1  # real samples, not one repeated
    two_rows, _ = v.sample_request(QUESTION, n=2)
    assert tokens(tiny_backend, two_rows, params) == alone[:2]
    other_rows, _ = v.sample_request(OTHER)  # a longer prompt: padding and batch size change
    assert tokens(tiny_backend, other_rows + rows, params)[4:] == alone
    assert tokens(tiny_backend, rows[::-1], params) == alone[::-1]
    drafting = HFBackend(tiny_backend.loaded, lookup_draft_tokens=3)
    first = tokens(drafting, rows, params)
    again = tokens(drafting, rows, params)  # now with the first call's outputs to draft from
    assert first == again == alone


def test_a_sampled_lookup_row_picks_the_tokens_plain_sampling_picks():
    """The speculative check takes, at each position, the row's draw for that token's index: the tokens
    plain sampling gives the row, whatever the draft."""
    from elm_memory.backends.decode import DecodeOptions, _verify
    from elm_memory.backends.sampling import pick_tokens

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.3, 0.0, 1.0, 0.0, 0.0], [0.0] * 5])
    opts = DecodeOptions(8, temperature=0.8)

    def plain(key: int, index: int, position: int) -> int:  # the token plain sampling gives token ``index``
        one = torch.ones(1)
        return int(
            pick_tokens(
                logits[position : position + 1],
                one * 0.8,
                one,
                torch.tensor([key]),
                torch.tensor([index]),
                any_sampled=True,
                any_nucleus=False,
            )[0]
        )

    seen = set()
    for key in range(40):
        for draft in ([0, 2], [1, 1], [4, 0]):
            took, nxt = _verify(logits, draft, opts, key, 5)
            assert [*took, nxt] == [plain(key, 5 + pos, pos) for pos in range(len(took) + 1)]
            seen.add(len(took))
    assert seen == {0, 1, 2}  # drafts refused at once, after one, and taken whole


# ---- methods: bad input before any model ------------------------------------------------------


def test_unknown_methods_and_k_below_one_fail_before_any_model(tmp_path):
    from elm_memory.data.datasets import Problem
    from elm_memory.eval.online import run_stream

    cfg = ELMConfig.load(preset="cpu-tiny")
    with pytest.raises(RegistryError, match="no_such_method"):
        run_stream([Problem("q", "1+1?", "2")], ["zero_shot", "no_such_method"], cfg, tmp_path)
    with pytest.raises(ConfigError, match="consistency_samples"):
        ELMConfig.load(preset="cpu-tiny", overrides={"verifier": {"consistency_samples": 0}})
    out = subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", "stream", "--dataset", "synth-arith", "--limit", "2"]
        + ["--out", str(tmp_path / "r"), "-m", "self_consistency", "--set", "verifier.consistency_samples=0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "consistency_samples" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


# ---- the baselines and the records on the real tiny model --------------------------------------


@pytest.mark.model
def test_baselines_and_records_on_the_tiny_model(tiny_loaded, tiny_backend, tmp_path, evidence_config):
    """One stream with every compute-matched baseline beside ELM: self_consistency votes on the greedy
    answer and the very samples ELM's verifier draws; records carry the sample answers, seeds and training
    votes; elm_untrained stores each memory's initial soft prompt (no training step)."""
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog
    from elm_memory.training.learn import initial_memory

    cfg = evidence_config
    problems = load_problems("synth-arith", limit=2, seed=3)
    methods = ["zero_shot", "self_consistency", "maj_at_k", "elm_untrained", "elm_input"]
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    result = run_stream(
        problems, methods, cfg, tmp_path, dataset="synth-arith", seed=3, runtime=runtime, progress=False, plots=False
    )
    by = {(r["method"], r["index"]): r for r in RecordLog(tmp_path / "records.jsonl").read()}
    seeds = sample_seeds(cfg.training.seed, problems[1].question, 3)
    for m in ("self_consistency", "maj_at_k"):
        r = by[(m, 1)]
        assert r["route"] == "vote" and len(r["extra"]["verifier_sample_answers"]) == 3
        assert r["extra"]["seeds"]["verifier_samples"] == seeds
    sc = by[("self_consistency", 1)]
    assert sc["candidates"][0]["answer"] == by[("zero_shot", 1)]["answer"]  # greedy: the zero_shot answer
    assert by[("maj_at_k", 1)]["extra"]["verifier_sample_answers"] == sc["extra"]["verifier_sample_answers"]
    for m in ("elm_untrained", "elm_input"):
        second = by[(m, 1)]  # a memory was retrieved: the samples were drawn and are recorded with seeds
        assert second["memory_id"] and second["extra"]["verifier_sample_answers"] is not None
        drawn = second["extra"]["verifier_sample_answers"]
        assert second["extra"]["seeds"]["verifier_samples"] == seeds[: len(drawn)]
        # ELM drew the same samples the baselines voted on (same seeds; up to the answers' token budget)
        assert drawn == sc["extra"]["verifier_sample_answers"]
        assert "memory_votes" in second["extra"] and "learned_votes" in by[(m, 0)]["extra"]
    assert (
        by[("elm_input", 0)]["extra"]["learned_votes"]["steps"]
        and len(by[("elm_input", 0)]["extra"]["learned_votes"]["steps"][0][0]) == 2
    )  # [answer, count]
    assert by[("elm_untrained", 0)]["extra"]["learned_votes"]["steps"] == []  # S = 0: no rollouts
    assert by[("elm_untrained", 0)]["extra"]["seeds"]["rollout_steps"] == []
    # elm_untrained's memory is exactly its init and took no step; elm_input's took its S = 1
    from elm_memory.store.registry import stores

    store_cfg = cfg.store.model_copy(update={"path": str(tmp_path / "store"), "kind": cfg.store.kind})
    store = stores.get(store_cfg.kind).from_config(store_cfg, model=tiny_loaded.info)
    for m, trained in (("elm_untrained", False), ("elm_input", True)):
        [memory] = [
            x for x in (store.get(rec.id, m) for rec in store.list(m)) if x.meta.question == problems[0].question
        ]
        init = initial_memory(cfg, tiny_loaded, problems[0].question)
        assert memory.meta.stats.steps == (1 if trained else 0)
        if not trained:  # (SmolLM2's rollouts earn no reward, so elm_input's steps skip their backward too)
            assert torch.equal(memory.soft_prompt.float(), init.float())
    # the table sets ELM against each baseline; comparisons.json keeps the rows
    comparisons = json.loads((tmp_path / "comparisons.json").read_text())
    pairs = {(r["method"], r["baseline"]) for r in comparisons["head_to_head"]}
    assert {("elm_input", b) for b in ("zero_shot", "self_consistency", "maj_at_k", "elm_untrained")} <= pairs
    assert "| elm_input | self_consistency |" in result.table
    assert [c["method"] for c in comparisons["self_consistency_counterfactual"]] == ["elm_untrained", "elm_input"]


# ---- the sweep ---------------------------------------------------------------------------------


def test_sweep_grid_parsing_points_and_inits():
    from elm_memory.eval.sweep import grid_points, init_point, parse_grid

    grid = parse_grid(["S=0,4", "lr=1e-4,1e-2", "k=8", "min_share=0.5"])
    assert grid == {"S": [0, 4], "lr": [0.0001, 0.01], "k": [8], "min_share": [0.5]}
    points = grid_points(grid)
    assert len(points) == 4 and points[3].name == "S4-lr0.01-k8-min_share0.5"
    assert points[3].overrides == {
        "training.steps": 4,
        "training.learning_rate": 0.01,
        "memory.num_tokens": 8,
        "training.skip_below_majority_share": 0.5,
    }
    # the untrained init keeps what the initial memory depends on (k), nothing of the training
    assert init_point(points[3]).overrides == {"memory.num_tokens": 8, "training.steps": 0}
    assert init_point(points[0]).name == init_point(points[3]).name == "init-num_tokens8"
    assert parse_grid(["training.beta=0,0.1"]) == {"training.beta": [0, 0.1]}
    for bad, message in (
        (["wobble=1,2"], "unknown sweep setting 'wobble'"),
        (["S"], "not NAME=V1,V2"),
        (["S=1", "S=2"], "given twice"),
        ([], "grid is empty"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_grid(bad)


def test_sweep_points_with_an_unknown_config_key_fail_before_any_model():
    from elm_memory.eval.sweep import check_points, grid_points, parse_grid

    cfg = ELMConfig.load(preset="cpu-tiny")
    with pytest.raises(ConfigError, match="training.wobble"):
        check_points(cfg, grid_points(parse_grid(["training.wobble=1"])))
    with pytest.raises(ConfigError, match="model section"):
        check_points(cfg, grid_points(parse_grid(["model.name_or_path=other"])))
    out = subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", "sweep", "--dataset", "synth-arith", "--out", "/nonexistent/x"]
        + ["--grid", "S=1", "--grid", "wobble=2", "--preset", "cpu-tiny"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "unknown sweep setting 'wobble'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_dev_questions_avoid_the_reported_streams_and_come_in_families():
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.sweep import REPORTED_SEEDS, dev_problems

    dev = dev_problems("synth-arith", 6, per_family=2)
    reported = {p.id for s in REPORTED_SEEDS for p in load_problems("synth-arith", limit=60, seed=s)}
    assert len(dev) == 6 and not {p.id for p in dev} & reported
    # the first three are one per family (the memories' sources), then a second of each family
    assert len({p.family for p in dev[:3]}) == 3 and [p.family for p in dev[3:]] == [p.family for p in dev[:3]]
    assert dev_problems("synth-arith", 6, per_family=2) == dev  # deterministic
    other = dev_problems("synth-arith", 6, per_family=2, seed=1)  # elm sweep --dev-seed: another sample
    assert other != dev and not {p.id for p in other} & reported


def test_sweep_rows_split_own_family_and_unrelated(tmp_path):
    from elm_memory.data.datasets import Problem
    from elm_memory.eval.records import RecordLog
    from elm_memory.eval.sweep import SweepPoint, markdown_sweep, sweep_row

    problems = [Problem("a1", "q", "1", family="A"), Problem("a2", "q", "2", family="A"), Problem("b1", "q", "3", "B")]
    point, init = SweepPoint("S4", {"training.steps": 4}, {"S": 4}), SweepPoint("init", {"training.steps": 0})
    zs = {"a1": False, "a2": True, "b1": False}
    trained = {("a1", "a1"): True, ("a1", "a2"): True, ("a1", "b1"): True}
    untrained = {("a1", "a1"): False, ("a1", "a2"): False, ("a1", "b1"): True}
    for name, evals in (("S4", trained), ("init", untrained)):
        for qid, ok in zs.items():
            RecordLog(tmp_path / name / "zero_shot.jsonl").append({"question_id": qid, "correct": ok})
        for (src, qid), ok in evals.items():
            RecordLog(tmp_path / name / "evals.jsonl").append(
                {"memory_id": "m", "source_question_id": src, "question_id": qid, "correct": ok}
            )
    RecordLog(tmp_path / "S4" / "memories.jsonl").append(
        {
            "memory_id": "m",
            "question_id": "a1",
            "majority_share": 0.5,
            "skipped_backward": [False, True],
            "seconds": 3,
            # step 1: one of four rollouts says the gold "1" (as "1.0"); step 2: three of four
            "votes": [[["1.0", 1], ["7", 2], [None, 1]], [["1", 3], ["2", 1]]],
            "mean_reward": [0.5, 0.75],
        }
    )
    row = sweep_row(tmp_path, point, init, problems)
    assert row["own"] == {
        "n": 1,
        "memory_correct": 1,
        "zero_shot_correct": 0,
        "vs_zero_shot": {"gains": 1, "losses": 0, "p": 1.0},
        "init_n": 1,
        "init_correct": 0,
        "vs_init": {"gains": 1, "losses": 0, "p": 1.0},
    }
    assert row["family"]["n"] == 1 and row["family"]["vs_zero_shot"]["gains"] == 0  # a2: both right
    assert row["family"]["vs_init"]["gains"] == 1
    assert row["unrelated"]["vs_zero_shot"]["gains"] == 1 and row["unrelated"]["vs_init"]["gains"] == 0
    assert row["updated_steps"] == 1 and row["mean_majority_share"] == 0.5
    assert row["own_rollouts"] == {
        "rollouts_first": 4,
        "right_first": 0.25,
        "rollouts_last": 4,
        "right_last": 0.75,
        "reward_first": 0.5,
        "reward_last": 0.75,
    }
    table = markdown_sweep([row])
    assert "| S4 | own | 1 | 1/1 | 0/1 | 0/1 | +1/−0 (1) | +1/−0 (1) | 0.50 |" in table
    assert "| 0.25 → 0.75 of 4 a step |" in table


@pytest.mark.model
def test_weak_majority_steps_skip_their_update(tiny_loaded, tiny_backend):
    """training.skip_below_majority_share: rollouts 7, 7, 8, 9 (share 0.5) update at 0.5, not at 0.75."""
    from _fakes import ScriptedRollouts

    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.training.learn import initial_memory, learn_memory

    scripted = ScriptedRollouts(tiny_backend, ["\\boxed{7}", "\\boxed{7}", "\\boxed{8}", "\\boxed{9}"])
    for threshold, skipped in ((0.75, True), (0.5, False)):
        cfg = ELMConfig.load(
            preset="cpu-tiny",
            overrides={"training": {"steps": 2, "num_generations": 4, "skip_below_majority_share": threshold}},
        )
        prompts = PromptBuilder(tiny_loaded.tokenizer, cfg.prompt, tiny_loaded.info.max_context)
        memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=scripted, prompts=prompts)
        assert memory.meta.stats.skipped_backward == [skipped, skipped]
        init = initial_memory(cfg, tiny_loaded, QUESTION)
        assert torch.equal(memory.soft_prompt, init.float()) == skipped


def test_offline_progress_lines_in_a_log(capsys, monkeypatch):
    """Not a terminal (a log, nohup): a line per phase and at most every LINE_SECONDS, with time left."""
    from elm_memory.eval import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    with progress.ProgressBar(None, total=4, completed=1, lines=True) as bar:
        bar.describe("learning memory 1/2 (0 done) · evaluations 0/4")
        bar.advance()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[progress] learning memory 1/2 (0 done) · evaluations 0/4 · 1/4 steps")
    assert "2/4 steps" in err[-1] and "min left" in err[-1]
    with progress.ProgressBar(None, total=4, completed=1) as bar:  # other runs stay silent in logs
        bar.describe("x")
        bar.advance()
    assert capsys.readouterr().err == ""


def test_stream_progress_lines_come_by_the_clock_not_by_phase(capsys, monkeypatch):
    """An online run's log has a line per question already: its progress lines come every `every` seconds only,
    the first step's at once, with hours once the time left passes 90 minutes."""
    from elm_memory.eval import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with progress.ProgressBar(None, total=200, completed=50, lines=True, every=600.0, phase_lines=False) as bar:
        bar.describe("elm_amortized · question 51/200")
        assert capsys.readouterr().err == ""  # a new phase alone prints nothing
        clock[0] += 90.0
        bar.advance()
        bar.describe("elm_amortized · question 52/200")
        clock[0] += 90.0
        bar.advance()  # 90 s after the last line: silent
        clock[0] += 600.0
        bar.advance()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("[progress] elm_amortized · question 51/200 · 51/200 steps · 1.5 min elapsed")
    assert err[0].endswith("about 3.7 h left")  # 149 steps at 90 s
    assert err[1].startswith("[progress] elm_amortized · question 52/200 · 53/200 steps · 13.0 min elapsed")
    assert err[1].endswith("about 10.6 h left")  # 147 steps at 780 s / 3


def test_time_left_takes_the_median_gap_so_a_stop_between_records_does_not_count():
    from elm_memory.eval.progress import duration_text, time_left

    records = [{"finished_at": t} for t in (0.0, 85.0, 170.0, 255.0, 5255.0, 5340.0)]  # stopped for 5000 s once
    assert time_left(records, 100) == 8500.0
    assert duration_text(8500.0) == "2.4 h" and duration_text(120.0) == "2.0 min"
    assert time_left(records[-20:], 0) == 0.0
    assert time_left(records[:1], 10) is None  # one timed record: no pace yet
    assert time_left([{"finished_at": None}, {}], 10) is None  # records written before they kept their time


def test_compare_pools_the_sign_test_over_seeds_by_distinct_question(tmp_path):
    """Two seeds that share q1: elm_input wins it in both, so it counts once; q2 is lost in one seed."""
    from elm_memory.eval.records import RecordLog
    from elm_memory.eval.seeds import compare_seeds, markdown_seeds

    runs = {
        17: [("q1", True, False), ("q2", True, True)],
        42: [("q1", True, False), ("q2", False, True)],
    }
    dirs = []
    for seed, rows in runs.items():
        d = tmp_path / f"s{seed}"
        d.mkdir()
        (d / "run.json").write_text(
            json.dumps({"dataset": "synth-arith", "seed": seed, "question_ids": ["q1", "q2"], "config": {}})
        )
        log = RecordLog(d / "records.jsonl")
        for i, (qid, elm_ok, zs_ok) in enumerate(rows):
            for method, ok in (("zero_shot", zs_ok), ("elm_input", elm_ok)):
                log.append({"method": method, "index": i, "question_id": qid, "correct": ok, "route": "zero_shot"})
        dirs.append(d)
    comparison = compare_seeds(dirs)
    [row] = comparison.head_to_head
    assert (row["method"], row["baseline"], row["questions"], row["wins"], row["losses"], row["ties"]) == (
        "elm_input",
        "zero_shot",
        2,
        1,
        1,
        0,
    )
    assert "| elm_input | zero_shot | 2 | +1 | −1 | 0 | 1 |" in markdown_seeds(comparison)
    assert comparison.to_json()["head_to_head"] == [row]


@pytest.mark.model
def test_verifier_at_2_samples_do_not_depend_on_the_batch(tiny_loaded, tiny_backend, tmp_path):
    """verifier_at_2 seeded a batch by its first question; now each sample row has its own seed."""
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.methods.baselines import verifier_at_2

    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"generation": {"max_new_tokens": 12}})
    method = verifier_at_2(EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend))
    together = method.answer_batch([OTHER, QUESTION], [0, 1])
    alone = method.answer_batch([QUESTION], [7])
    assert together[1].response == alone[0].response and together[1].candidates == alone[0].candidates
    assert together[0].response != together[1].response
