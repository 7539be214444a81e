"""Paired baselines on ELM's own generations (elm_memory.eval.paired): the route replay, the variants read
from a record, pooling over runs, and on the tiny model the records that feed them."""

from __future__ import annotations

import json

import pytest

from elm_memory.eval.paired import (
    ReplaySettings,
    markdown_paired,
    paired_answers,
    paired_curves,
    paired_summary,
    replay_route,
    replay_settings,
)

ON = ReplaySettings(replay=True, prefer_answered=True)


def _record(qid, gold, greedy, memory=None, samples=(), answer=None, twin=None, key="verifier_sample_answers"):
    candidates = [{"kind": "zero_shot", "answer": greedy}]
    extra = {key: list(samples)}
    if memory is not None:
        candidates.append({"kind": "memory", "answer": memory})
        extra["untrained_twin"] = {"memory_id": "m", "answer": twin}
    return {
        "method": "elm_input",
        "question_id": qid,
        "gold": gold,
        "answer": greedy if answer is None else answer,
        "candidates": candidates,
        "extra": extra,
    }


def test_the_route_replay_follows_the_graphs_rule():
    # agreeing answers win; exactly one answered wins; else the strictly higher agreement, ties to zero-shot
    assert replay_route("4", "4.0", ["5", "5"], prefer_answered=True) == "4"
    assert replay_route(None, "7", ["3"], prefer_answered=True) == "7"
    assert replay_route(None, "7", ["3"], prefer_answered=False) is None  # both score 0: zero-shot
    assert replay_route("3", "7", ["7", "7", "3"], prefer_answered=True) == "7"
    assert replay_route("3", "7", ["7", "3"], prefer_answered=True) == "3"


def test_variants_of_one_record_and_the_replay_check():
    r = _record("q1", "7", greedy="3", memory="7", samples=["7", "7", "3", "7", None], answer="7", twin="3")
    a = paired_answers(r, ON)
    assert a is not None
    assert a["zero_shot"] == "3" and a["memory"] == "7" and a["untrained_memory"] == "3"
    assert a["self_consistency"] == "7"  # greedy and one sample say 3, three samples 7
    assert a["maj_at_k"] == "7" and a["elm"] == "7"
    assert a["elm_untrained"] == "3" and a["replay_ok"] is True  # the twin agrees with greedy
    assert a["sc_memory"] == "7" and a["sc_untrained_memory"] == "3"  # 7 x4 vs 3 x2; then 7 x3 vs 3 x3: greedy
    # a recorded answer the replay cannot reproduce is flagged, not hidden
    wrong = _record("q1", "7", greedy="3", memory="7", samples=["3", "3"], answer="7", twin="3")
    assert paired_answers(wrong, ON)["replay_ok"] is False
    # no memory: ELM and its twin are zero-shot; the samples come from the evaluation's own draw
    plain = _record("q2", "5", greedy="5", samples=["4", "4", "5", "4"], key="baseline_sample_answers")
    b = paired_answers(plain, ON)
    assert b["elm_untrained"] == "5" and b["self_consistency"] == "4" and "memory" not in b
    # without samples nothing can be paired; without a consistency verifier nothing is replayed
    assert paired_answers({**plain, "extra": {}}, ON) is None
    assert "elm_untrained" not in paired_answers(r, ReplaySettings(replay=False, prefer_answered=True))


def test_curves_to_plot_beside_elm_come_from_its_own_records():
    win = {**_record("q1", "7", greedy="3", memory="7", samples=["7", "7", "3", "7"], answer="7", twin="3"), "index": 0}
    plain = {**_record("q2", "5", greedy="5", samples=["4", "4", "5", "4"]), "index": 1}
    unpaired = {**plain, "question_id": "q3", "index": 2, "extra": {}}  # no samples: left out of both curves
    zero = {**plain, "method": "zero_shot"}
    config = {"verifier": {"name": "consistency", "prefer_answered": True}}
    curves = paired_curves([win, plain, unpaired, zero], ["zero_shot", "elm_input"], config)
    assert curves == {
        "elm_input: self-consistency": [{"index": 0, "correct": True}, {"index": 1, "correct": False}],
        "elm_input: memory untrained": [{"index": 0, "correct": False}, {"index": 1, "correct": True}],
    }
    # another verifier: ELM's route cannot be replayed, so only self-consistency is drawn
    assert list(paired_curves([win], ["elm_input"], {"verifier": {"name": "prm"}})) == ["elm_input: self-consistency"]
    assert paired_curves([win], ["zero_shot"], config) == {}


def test_summary_pools_runs_by_distinct_question():
    win = _record("q1", "7", greedy="3", memory="7", samples=["7", "7", "3"], answer="7", twin="3")
    # seed 1 and seed 2 both answered q1: it counts once (a net win), q2 once (a tie)
    win["extra"]["memory_votes"] = {"majority_share": 0.75}
    win["extra"]["untrained_twin"]["moved"] = 0.1
    tie = _record("q2", "5", greedy="5", samples=["5"], key="baseline_sample_answers")
    s = paired_summary([[win, tie], [win]], "elm_input", ON)
    assert s is not None and s["records"] == 3 and s["paired"] == 3 and s["replay_mismatches"] == 0
    assert s["accuracy"]["elm"] == {"right": 3, "judged": 3}
    assert s["accuracy"]["zero_shot"] == {"right": 1, "judged": 3}
    rows = {(c["method"], c["baseline"]): c for c in s["comparisons"]}
    assert rows[("elm", "zero_shot")]["questions"] == 2 and rows[("elm", "zero_shot")]["wins"] == 1
    assert rows[("memory", "untrained_memory")]["wins"] == 1
    # self-consistency: greedy 3 + samples 7,7,3 -> a 2-2 tie, to greedy 3: ELM beats it on q1
    assert rows[("elm", "self_consistency")]["wins"] == 1
    assert "| elm | elm_untrained |" in markdown_paired(s)
    assert "| sc_memory | self-consistency + the memory's vote (verifier.route=vote) | " in markdown_paired(s)
    assert s["mean_moved"] == pytest.approx(0.1) and "10.0% of their norm" in markdown_paired(s)
    # q1's memory (share 0.75) was right both times, its twin and zero-shot never; q2 had no memory
    assert s["by_majority_share"] == [
        {"majority_share": 0.75, "memory": [2, 2], "untrained_memory": [0, 2], "zero_shot": [0, 2], "elm": [2, 2],
         "elm_untrained": [0, 2]}
    ]  # fmt: skip
    assert "| 0.75 | 2/2 | 0/2 | 0/2 | 2/2 | 0/2 |" in markdown_paired(s)
    assert paired_summary([[tie]], "elm_kv") is None
    assert s["never_moved"] == 0 and "never moved" not in markdown_paired(s)


def test_summary_counts_memories_that_never_moved():
    # a memory whose every step skipped its update is its init exactly: moved 0.0
    moved = _record("q1", "7", greedy="3", memory="7", samples=["7", "7", "3"], answer="7", twin="3")
    moved["extra"]["untrained_twin"]["moved"] = 0.2
    still = _record("q2", "5", greedy="5", memory="4", samples=["5", "5"], answer="5", twin="4")
    still["extra"]["untrained_twin"]["moved"] = 0.0
    s = paired_summary([[moved, still]], "elm_input", ON)
    assert s is not None and (s["never_moved"], s["with_moved"]) == (1, 2)
    assert s["mean_moved"] == pytest.approx(0.1)
    assert "10.0% of their norm from their init, on average, 1 of 2 never moved" in markdown_paired(s)


def test_replay_settings_read_the_runs_verifier():
    consistency = {"name": "consistency", "consistency_tie_samples": 0, "consistency_samples": 4}
    assert replay_settings({"verifier": {**consistency, "prefer_answered": True}}) == ReplaySettings(True, True, 4)
    assert replay_settings({"verifier": {**consistency, "consistency_tie_samples": 2}}).replay is False
    assert replay_settings({"verifier": {"name": "prm"}}) == ReplaySettings(False, False, None)


def test_the_vote_route_is_self_consistency_with_the_memory_as_the_last_vote():
    """graph.routing.voted_answer (the graph's vote) equals the sc_memory baseline's rule on every input of
    a small alphabet, so a vote run's ELM row is sc_memory by construction and its replay checks that."""
    import itertools
    import random

    from elm_memory.eval.methods.voting import majority_vote
    from elm_memory.graph.routing import voted_answer

    rng = random.Random(0)
    alphabet = ["1", "2", "2.0", "3", None, "\\text{}"]  # the last: not equivalent even to itself
    for _ in range(2000):
        zero, memory = rng.choice(alphabet), rng.choice(alphabet)
        samples = [rng.choice(alphabet) for _ in range(rng.randint(0, 5))]
        assert voted_answer(zero, samples, memory) == majority_vote([*samples, memory], zero, with_greedy=True)
    for zero, samples in itertools.product(alphabet, itertools.product(alphabet, repeat=2)):
        assert voted_answer(zero, samples) == majority_vote(samples, zero, with_greedy=True)
    vote = ReplaySettings(replay=True, k=4, vote=True)
    assert replay_settings({"verifier": {"name": "consistency", "route": "vote"}}).vote is True
    # zero-shot 3, memory 7, samples 7 7 3 9: 7 by four votes to two
    r = _record("q1", "7", greedy="3", memory="7", samples=["7", "7", "3", "9"], answer="7", twin="9")
    a = paired_answers(r, vote)
    assert a["replay_ok"] is True and a["elm"] == a["sc_memory"] == "7"
    assert a["elm_untrained"] == a["sc_untrained_memory"] == "3"  # twin 9: 3, 7 and 9 two votes each
    # samples 9 9 9 3: the vote answers 9, which neither candidate gave; the verify route cannot
    other = _record("q2", "9", greedy="3", memory="7", samples=["9", "9", "9", "3"], answer="9", twin="7")
    assert paired_answers(other, vote)["replay_ok"] is True and paired_answers(other, vote)["elm_untrained"] == "9"
    assert paired_answers(other, ON)["elm_untrained"] == "3" and paired_answers(other, ON)["replay_ok"] is False
    # no memory: under the vote ELM and its twin answer self-consistency, not greedy
    plain = _record("q3", "4", greedy="5", samples=["4", "4", "5", "4"], answer="4")
    assert paired_answers(plain, vote)["elm_untrained"] == "4"


def test_votes_count_k_samples_and_a_run_without_replay_has_no_elm_untrained_row():
    # a tie's extra draws (after the first k) are the verifier's, not self-consistency's
    r = _record("q1", "1", greedy="1", memory="2", samples=["2", "2", "1", "1", "2", "2", "3", "3"], answer="2")
    assert paired_answers(r, ReplaySettings(replay=False, k=4))["self_consistency"] == "1"
    assert paired_answers(r, ReplaySettings(replay=False))["self_consistency"] == "2"
    plain = _record("q2", "5", greedy="5", samples=["5"], key="baseline_sample_answers")
    assert "elm_untrained" not in paired_answers(plain, ReplaySettings(replay=False))
    # an answer equivalent() cannot compare (empty after normalising) still replays as itself
    odd = _record("q3", "7", greedy="\\text{}", memory="7", samples=["1", "2"], answer="\\text{}", twin="7")
    assert paired_answers(odd, ON)["replay_ok"] is True


@pytest.mark.model
def test_paired_records_on_the_tiny_model(tiny_loaded, tiny_backend, tmp_path, evidence_config):
    """An ELM run records what the paired rows need: the untrained twin (the retrieved memory's init, the
    answer's params) and, where ELM drew none, the samples; self-consistency read from them is the
    self_consistency method's answer on the same question."""
    from elm_memory.backends.base import SamplingParams
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.methods.voting import majority_vote
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog
    from elm_memory.training.learn import initial_memory

    cfg = evidence_config
    problems = load_problems("synth-arith", limit=3, seed=3)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    result = run_stream(
        problems,
        ["self_consistency", "elm_input"],
        cfg,
        tmp_path,
        dataset="synth-arith",
        seed=3,
        runtime=runtime,
        progress=False,
        plots=False,
    )
    records = RecordLog(tmp_path / "records.jsonl").read()
    elm = {r["index"]: r for r in records if r["method"] == "elm_input"}
    sc = {r["index"]: r for r in records if r["method"] == "self_consistency"}
    assert "untrained_twin" not in elm[0]["extra"] and len(elm[0]["extra"]["baseline_sample_answers"]) == 3
    for i in (1, 2):
        twin = elm[i]["extra"]["untrained_twin"]
        assert twin["memory_id"] == elm[i]["memory_id"] and "response" in twin
        # the twin decodes the memory's own question's init: the same text as a direct greedy call with it
        from elm_memory.store.registry import stores

        store_cfg = cfg.store.model_copy(update={"path": str(tmp_path / "store")})
        store = stores.get(store_cfg.kind).from_config(store_cfg, model=tiny_loaded.info)
        memory = store.get(twin["memory_id"], "elm_input")
        init = initial_memory(cfg, tiny_loaded, memory.meta.question)
        prompt = runtime.prompts.answer_prompt(problems[i].question, memory_tokens=cfg.memory.num_tokens)
        params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_at_answer=True, seed=cfg.training.seed)
        [[direct]] = tiny_backend.generate([prompt.with_memory(init)], params)
        assert direct.text == twin["response"]
    for i in range(3):  # the self-consistency the paired rows read equals the method's own answer
        extra = elm[i]["extra"]
        samples = extra.get("verifier_sample_answers") or extra.get("baseline_sample_answers")
        assert samples == sc[i]["extra"]["verifier_sample_answers"]
        assert majority_vote(samples, elm[i]["candidates"][0]["answer"], with_greedy=True) == sc[i]["answer"]
    paired = json.loads((tmp_path / "comparisons.json").read_text())["paired"]
    assert paired[0]["method"] == "elm_input" and paired[0]["paired"] == 3 and paired[0]["replay_mismatches"] == 0
    assert "Paired on elm_input's own generations" in result.table
