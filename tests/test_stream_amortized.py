"""``stream.serving: amortized``: the gate (pure), the graph's turn on scripted streams (SmolLM2-135M's real weights
learn; a scripted backend decides what each row answers), the version log and pinning, and the evaluation method."""

from __future__ import annotations

import json

import pytest
import torch

from elm_memory.backends.base import Generation, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.graph.stream_turn import is_probe
from elm_memory.training.stream_gate import PROBATION, SERVING, WARMUP, AmortizationGate, GateReading, samples_vote


# -- the gate, pure ------------------------------------------------------------------------
def _win():
    return GateReading.of("5", "6", ["5", "5", "6"])


def _loss():
    return GateReading.of("6", "5", ["5", "5", "6"])


def test_a_reading_compares_both_greedy_answers_with_the_samples_vote_alone():
    assert _win().outcome == "win" and _loss().outcome == "loss"
    assert GateReading.of("5", "5", ["5", "5"]).outcome == "tie"
    assert GateReading.of("7", "8", ["5", "5"]).outcome == "tie"  # neither agrees: no information either
    assert GateReading.of("5", "6", ["5", "6"]).outcome == "no_vote"  # a tied vote is no reading
    assert samples_vote([None, None]) is None and samples_vote(["3", None, "3"]) == "3"


def test_the_gate_opens_after_enough_wins_and_not_before_its_minimum():
    gate = AmortizationGate(margin=0.75, alpha=0.25, min_questions=6)  # threshold log 4: four net wins
    decisions = [gate.observe(_win(), version=v) for v in range(5)]
    assert decisions == [None] * 5 and gate.state == WARMUP  # four wins are enough, five readings are not
    decision = gate.observe(_win(), version=5)
    assert decision is not None and decision.state == SERVING and decision.previous == WARMUP
    assert gate.serving and gate.approved_version == 5 and decision.wins == 6 and decision.losses == 0


def test_losses_hold_the_gate_shut_and_a_mixed_stream_never_opens_it():
    gate = AmortizationGate(margin=0.75, alpha=0.05, min_questions=1)
    for i in range(200):  # the memory agrees with the vote exactly as often as zero-shot
        assert gate.observe(_win() if i % 2 else _loss(), version=i) is None
    assert gate.state == WARMUP and gate.open_stat < gate.threshold


def test_the_gate_closes_when_zero_shot_wins_and_keeps_the_version_it_approved():
    gate = AmortizationGate(margin=0.75, alpha=0.25, min_questions=1)
    for v in range(4):
        gate.observe(_win(), version=v)
    assert gate.serving and gate.approved_version == 3
    assert [gate.observe(_loss(), version=9) for _ in range(3)] == [None] * 3
    decision = gate.observe(_loss(), version=9)
    assert decision is not None and decision.state == PROBATION and decision.approved_version == 3
    assert gate.state == PROBATION and gate.readings == 0  # a fresh test before it may open again


def test_the_gates_state_round_trips_through_json_with_the_configured_test():
    gate = AmortizationGate(margin=0.75, alpha=0.25, min_questions=1)
    for v in range(5):
        gate.observe(_win(), version=v)
    stored = json.loads(json.dumps(gate.to_json()))
    back = AmortizationGate.from_json(stored, margin=0.8, alpha=0.1, min_questions=2)
    assert back.state == SERVING and back.approved_version == gate.approved_version and back.counts == gate.counts
    assert (back.margin, back.alpha, back.min_questions) == (0.8, 0.1, 2)
    with pytest.raises(ValueError, match="above one half"):
        AmortizationGate(margin=0.5)


def _tie():
    return GateReading.of("5", "5", ["5", "5", "6"])


def _non_inferiority(**kw):
    return AmortizationGate(**{"test": "non_inferiority", "tolerance": 0.05, "alpha": 0.05, "min_questions": 16, **kw})


def test_non_inferiority_opens_on_a_memory_that_answers_as_zero_shot_and_counts_its_ties():
    gate = _non_inferiority()
    opened = next(i for i in range(1000) if gate.observe(_tie(), version=i) is not None)
    assert 16 <= opened < 400 and gate.serving and gate.approved_version == opened
    decisions = [gate.observe(_tie(), version=9) for _ in range(50)]
    assert decisions == [None] * 50 and gate.serving  # not behind: serving stays


def test_non_inferiority_ignores_questions_without_a_vote_and_respects_its_minimum():
    gate = _non_inferiority(min_questions=10_000)
    no_vote = GateReading.of("5", "6", ["5", "6"])
    for i in range(300):
        gate.observe(no_vote, version=i)
    assert gate.open_stat == 0.0 and gate.close_stat == 0.0
    for i in range(600):
        assert gate.observe(_win(), version=i) is None  # overwhelming evidence, too few readings
    assert gate.open_stat > gate.threshold and gate.state == WARMUP


def test_non_inferiority_keeps_a_memory_behind_by_more_than_its_tolerance_shut():
    gate = _non_inferiority(min_questions=1)
    for i in range(1000):  # one loss in ten, no win: 0.1 behind against a tolerance of 0.05
        assert gate.observe(_loss() if i % 10 == 0 else _tie(), version=i) is None
    assert gate.open_stat < 0.0 and gate.state == WARMUP


@pytest.mark.slow
@pytest.mark.extended
def test_non_inferiority_holds_its_alpha_at_the_boundary_however_often_it_is_read():
    import random

    rng = random.Random(7)
    opened = 0
    for _ in range(200):  # E[D] = 0.10 - 0.15 = -tolerance exactly: each opening is a false one
        gate = _non_inferiority(min_questions=1)
        for i in range(400):
            u = rng.random()
            reading = _win() if u < 0.10 else _loss() if u < 0.25 else _tie()
            if gate.observe(reading, version=i) is not None:
                opened += 1
                break
    assert opened <= 200 * 0.05 + 6  # Ville: at most alpha, with room for the 200 streams' noise


def test_non_inferiority_closes_when_the_memory_falls_behind_and_keeps_its_approved_version():
    gate = _non_inferiority(min_questions=1)
    v = 0
    while not gate.serving:
        gate.observe(_win(), version=v)
        v += 1
    approved = gate.approved_version
    closing = [gate.observe(_loss(), version=99) for _ in range(40)]
    decision = next(d for d in closing if d is not None)
    assert decision.state == PROBATION and decision.test == "non_inferiority"
    assert decision.approved_version == approved and "more often than the memory" in decision.reason


def _sample_share(**kw):
    return _non_inferiority(**{"test": "sample_share", **kw})


def test_a_reading_carries_each_greedy_answers_share_of_the_samples():
    reading = GateReading.of("5", "6", ["5", "6", "6", None])
    assert (reading.memory_share, reading.zero_shot_share, reading.share_difference) == (0.25, 0.5, -0.25)
    assert GateReading.of(None, "6", ["6", "6"]).memory_share == 0.0  # no answer is supported by nothing
    assert GateReading.of("5", "6", []).share_difference == 0.0


def test_sample_share_reads_questions_whose_vote_is_tied_and_opens_on_a_memory_the_samples_back_as_often():
    split = GateReading.of("5", "6", ["5", "6"])  # no vote: no reading for non_inferiority, d = 0 here
    assert split.outcome == "no_vote" and split.share_difference == 0.0
    gate = _sample_share()
    opened = next(i for i in range(1000) if gate.observe(split, version=i) is not None)
    assert 16 <= opened < 400 and gate.serving and gate.counts == {"tie": opened + 1}
    again = _sample_share()
    decision = next(d for d in (again.observe(split, version=i) for i in range(1000)) if d is not None)
    assert decision.test == "sample_share" and decision.readings == opened + 1
    assert "the samples give the memory's answer at least as often as zero-shot's, less 0.05" in decision.reason


def test_sample_share_keeps_a_memory_behind_by_more_than_its_tolerance_shut_and_closes_when_it_falls_behind():
    behind = GateReading.of("6", "5", ["5", "5", "6", "6", "5"])  # d = 0.4 - 0.6 = -0.2
    gate = _sample_share(min_questions=1)
    for i in range(1000):  # one such question in two: 0.1 behind against a tolerance of 0.05
        assert gate.observe(behind if i % 2 == 0 else _tie(), version=i) is None
    assert gate.state == WARMUP and gate.open_stat < 0.0
    gate = _sample_share(min_questions=1)
    while not gate.serving:
        gate.observe(_win(), version=1)
    decision = next(d for d in (gate.observe(behind, version=2) for _ in range(200)) if d is not None)
    assert decision.state == PROBATION and gate.share_sum == 0.0  # a fresh test after the change


def test_sample_share_holds_its_alpha_at_the_boundary_however_often_it_is_read():
    import random

    rng = random.Random(11)
    readings = {  # shares of five samples: d in steps of 0.2
        0.4: GateReading.of("5", "6", ["5", "5", "5", "6", "7"]),
        -0.4: GateReading.of("6", "5", ["5", "5", "5", "6", "7"]),
        0.0: _tie(),
    }
    opened = 0
    for _ in range(200):  # E[d] = 0.4 * 0.15 - 0.4 * 0.275 = -0.05 = -tolerance exactly: each opening is false
        gate = _sample_share(min_questions=1)
        for i in range(400):
            u = rng.random()
            d = 0.4 if u < 0.15 else -0.4 if u < 0.425 else 0.0
            if gate.observe(readings[d], version=i) is not None:
                opened += 1
                break
    assert opened <= 200 * 0.05 + 6


def test_a_changed_gate_test_starts_its_statistics_afresh():
    gate = AmortizationGate(margin=0.75, alpha=0.25, min_questions=100)
    for v in range(5):
        gate.observe(_win(), version=v)
    stored = json.loads(json.dumps(gate.to_json()))
    same = AmortizationGate.from_json(stored, margin=0.75, alpha=0.25, min_questions=100)
    assert same.open_stat == gate.open_stat and same.wins == 5
    other = AmortizationGate.from_json(stored, margin=0.75, alpha=0.25, min_questions=100, test="non_inferiority")
    assert other.test == "non_inferiority" and other.open_stat == 0.0 and other.wins == 0
    assert other.counts == gate.counts and other.total_readings == 5  # the stream's record stays
    with pytest.raises(ValueError, match="unknown gate test"):
        AmortizationGate(test="bayes")
    with pytest.raises(ValueError, match="tolerance"):
        AmortizationGate(test="non_inferiority", tolerance=0.0)


def test_probes_are_a_share_of_questions_picked_by_their_hash():
    questions = [f"What is {i} + {i}?" for i in range(2000)]
    picked = [q for q in questions if is_probe(q, 0, 0.1)]
    assert 150 < len(picked) < 250  # about a tenth
    assert picked == [q for q in questions if is_probe(q, 0, 0.1)]  # the same question, the same pick
    assert all(is_probe(q, 0, 1.0) for q in questions[:10])


def test_amortized_serving_learns_from_zero_shot_samples_by_sft_unless_told_otherwise():
    cfg = ELMConfig.load(preset="cpu-demo", overrides={"stream": {"mode": "stream", "serving": "amortized"}})
    assert (cfg.stream.tuning.learn_from, cfg.stream.tuning.objective) == ("zero_shot", "sft")
    voting = ELMConfig.load(preset="cpu-demo", overrides={"stream": {"mode": "stream"}}).stream.tuning
    assert (voting.learn_from, voting.objective) == ("own", "grpo")  # the vote keeps the paper's
    with pytest.raises(ConfigError, match="stream.tuning.learn_from=zero_shot"):
        ELMConfig.load(overrides={"stream": {"serving": "amortized", "tuning": {"learn_from": "own"}}})
    with pytest.raises(ConfigError, match="stream.tuning.objective=sft"):
        ELMConfig.load(overrides={"stream": {"serving": "amortized", "tuning": {"objective": "grpo"}}})
    cfg = ELMConfig.load(preset="cpu-amortized")  # the preset sets what it needs, on cpu-demo's values
    assert cfg.stream.serving == "amortized" and cfg.stream.kind == "lora"
    assert cfg.verifier.name == "consistency" and cfg.generation.max_new_tokens == 384


def test_the_gates_read_share_is_a_share_and_has_no_old_flat_spelling():
    assert ELMConfig.load(preset="cpu-amortized").stream.tuning.gate_read_share == 1.0  # every question, as before
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="gate_read_share"):
            ELMConfig.load(overrides={"stream": {"tuning": {"gate_read_share": bad}}})
    with pytest.raises(ConfigError, match="gate_read_share"):  # added inside stream.tuning: no flat key to move
        ELMConfig.load(overrides={"stream": {"gate_read_share": 0.5}})


# -- the graph's turn on scripted streams ---------------------------------------------------------
class Script:
    """Answers ``memory`` for a row under the stream memory, ``zero`` for a greedy row without it, and ``samples``
    in turn for sampled rows; counts rows per call."""

    name = "scripted"

    def __init__(
        self, real, memory="\\boxed{5}", zero="\\boxed{6}", samples=("\\boxed{5}", "\\boxed{5}", "\\boxed{6}")
    ):
        self.tokenizer, self.info = real.tokenizer, real.info
        self.memory, self.zero, self.samples = memory, zero, list(samples)
        self.calls: list[int] = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            if p.soft_prompt is not None or p.memory is not None:
                text = self.memory
            else:
                text = self.zero if params.temperature == 0 else self.samples[i % len(self.samples)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append([Generation(text=text, token_ids=ids, finish_reason="stop") for _ in range(params.n)])
        return out


def _amortized(tmp_path, **stream):
    from _fakes import stream_graph_config

    settings = {"serving": "amortized", "objective": "sft", "learn_from": "zero_shot", "gate_alpha": 0.25}
    return stream_graph_config(tmp_path, **{**settings, "gate_min_questions": 3, **stream})


def _elm(smol, cfg, script):
    from elm_memory import ELM

    return ELM(cfg, loaded=smol, backend=script)


def _tokens(script, text):
    return len(script.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_during_warm_up_the_vote_answers_and_every_row_is_counted(smol, tmp_path):
    script = Script(smol, memory="\\boxed{7}", zero="\\boxed{5}")
    with _elm(smol, _amortized(tmp_path), script) as elm:
        result = elm.answer("What is 2 + 3?")
    assert result.answer == "5" and result.route == "vote"  # self-consistency: 5 (greedy) + 5, 5, 6
    turn = result.stream_turn
    assert turn["mode"] == "self_consistency" and turn["gate"] == WARMUP and turn["probe"]
    expected = 3 * _tokens(script, "\\boxed{5}") + _tokens(script, "\\boxed{7}") + _tokens(script, "\\boxed{6}")
    assert turn["tokens"] == expected  # zero-shot, the memory, the three samples
    assert result.stream_update["gate"]["outcome"] == "loss"  # only zero-shot agrees with the samples' 5
    assert result.stream_update["applied"] and result.stream_update["label"] == "5"


def test_the_gate_opens_on_a_stream_where_the_memory_agrees_with_the_vote_and_it_then_answers_alone(smol, tmp_path):
    script = Script(smol)  # memory 5, zero-shot 6, samples 5, 5, 6: every probe is a win for the memory
    cfg = _amortized(tmp_path, probe_share=0.01)
    with _elm(smol, cfg, script) as elm:
        results = [elm.answer(f"What is {i} + 5?") for i in range(4)]
        assert [r.stream_turn["gate"] for r in results] == [WARMUP] * 4
        decision = results[-1].stream_update["gate_decision"]
        assert decision["state"] == SERVING and decision["wins"] == 4
        question = next(
            f"What is {i} * 3?" for i in range(100) if not is_probe(f"What is {i} * 3?", cfg.training.seed, 0.01)
        )
        script.calls.clear()
        alone = elm.answer(question)
        stream = elm.services().stream_memory("default")
        streams_row = stream.summary()["gate"]
    assert alone.answer == "5" and alone.route == "stream"
    assert alone.stream_turn["mode"] == "memory" and alone.stream_turn["tokens"] == _tokens(script, "\\boxed{5}")
    assert script.calls == [1] and [c["kind"] for c in alone.candidates] == ["stream"]  # one row, one decode
    assert alone.stream_update["skipped"] == "not_probed"  # no samples, nothing to learn or read
    assert streams_row["state"] == SERVING and streams_row["decisions"][0]["state"] == SERVING
    from elm_memory.cli.memory_views import stream_lines
    from elm_memory.store.stream_files import list_streams, stream_root

    header, row, decision = stream_lines(list_streams(stream_root(cfg.store.path)))[:3]
    assert "gate" in header and " serving " in row  # elm memories streams: the state, then why it changed
    assert decision.strip().startswith("gate warmup -> serving: memory agrees") and "4 wins, 0 losses" in decision


@pytest.mark.parametrize(
    ("test", "reason"),
    [
        ("non_inferiority", "at least as often as zero-shot, less 0.45"),
        pytest.param(
            "sample_share",
            "the samples give the memory's answer at least as often as zero-shot's, less 0.45",
            marks=(pytest.mark.slow, pytest.mark.extended),
        ),
    ],
)
def test_the_configured_non_inferiority_gate_reads_the_turns_and_says_why_it_opened(smol, tmp_path, test, reason):
    script = Script(smol, memory="\\boxed{5}", zero="\\boxed{5}")  # the memory answers as zero-shot: ties only
    cfg = _amortized(tmp_path, probe_share=0.01, gate_test=test, gate_tolerance=0.45)
    with _elm(smol, cfg, script) as elm:
        results = []
        while not results or not results[-1].stream_update["gate_decision"]:
            assert len(results) < 12, "the gate never opened on ties at tolerance 0.45"
            results.append(elm.answer(f"What is {len(results)} + 5?"))
        stream = elm.services().stream_memory("default")
    assert stream.gate.test == test and stream.gate.serving
    assert [r.stream_update["gate"]["outcome"] for r in results] == ["tie"] * len(results)
    decision = results[-1].stream_update["gate_decision"]
    assert decision["test"] == test and decision["readings"] == len(results) >= 3
    assert reason in decision["reason"]


def test_the_gate_closes_when_the_memory_falls_behind_and_the_approved_version_serves_again(smol, tmp_path):
    script = Script(smol)
    cfg = _amortized(tmp_path, probe_share=1.0)
    with _elm(smol, cfg, script) as elm:
        for i in range(4):
            elm.answer(f"What is {i} + 5?")
        stream = elm.services().stream_memory("default")
        approved = stream.gate.approved_version
        kept = stream.files.read(approved)[0].params
        script.memory, script.zero = "\\boxed{6}", "\\boxed{5}"  # now zero-shot agrees with the vote, not the memory
        probes = [elm.answer(f"What is {i} - 1?") for i in range(4)]
    assert [p.stream_turn["mode"] for p in probes] == ["memory_probe"] * 4
    assert all(p.answer == "6" for p in probes)  # the memory answered while the gate was open
    last = probes[-1].stream_update
    assert last["gate_decision"]["state"] == PROBATION and last["skipped"] == "gate_closed"
    assert stream.gate.state == PROBATION
    assert all(torch.equal(stream.params[n].detach(), kept[n].float()) for n in kept)  # the approved tensors
    history = stream.files.read_history()
    assert history[-1]["rollback_to"] == approved and "gate closed" in history[-1]["reasons"][0]


def test_an_unboxed_memory_answer_falls_back_to_the_vote(smol, tmp_path):
    script = Script(smol)
    cfg = _amortized(tmp_path, probe_share=0.01)
    with _elm(smol, cfg, script) as elm:
        for i in range(4):
            elm.answer(f"What is {i} + 5?")
        script.memory = "I think it is five"
        question = next(
            f"What is {i} * 3?" for i in range(100) if not is_probe(f"What is {i} * 3?", cfg.training.seed, 0.01)
        )
        script.calls.clear()
        result = elm.answer(question)
    # self-consistency: zero-shot's 6 and the samples 5, 5, 6, a tie that goes to the greedy answer
    assert result.stream_turn["mode"] == "memory_fallback" and result.answer == "6" and result.route == "vote"
    assert script.calls == [1, 1, 3]  # the memory's row, then zero-shot's and the samples
    assert any("no \\boxed{}" in w for w in result.warnings)
    assert result.stream_update["gate"] is None  # the fallback teaches the memory but is no gate reading


def test_the_evaluations_extra_rows_change_no_decision(smol, tmp_path):
    """A turn measured (every row drawn) answers, spends and learns exactly as the same turn unmeasured."""
    from elm_memory.graph.nodes import answer_params
    from elm_memory.graph.stream_turn import StreamTurn
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    script = Script(smol)
    cfg = _amortized(tmp_path, probe_share=0.01)
    with _elm(smol, cfg, script) as elm:
        for i in range(4):
            elm.answer(f"What is {i} + 5?")
        svc = elm.services()
        stream = svc.stream_memory("default")
        sampler = ConsistencyVerifier.from_config(cfg, script)
        outcomes = []
        for measure in (False, True):
            question = "What is 7 * 3?"
            prompt = svc.prompts.answer_prompt(question, memory_tokens=cfg.memory.num_tokens)
            params = answer_params(cfg, prompt, script.info.max_context)
            turn = StreamTurn.plan(cfg, stream, question, "default", measure=measure)
            requests, greedy = turn.requests(cfg, stream, prompt, params, sampler)
            turn.read(script_generate(script, requests), greedy)
            outcomes.append((turn.answer, turn.mode, turn.tokens, turn.probe, len(turn.samples)))
    assert outcomes[0][:4] == outcomes[1][:4]
    assert (outcomes[0][4], outcomes[1][4]) == (0, 3)  # the samples were drawn for the measurement only


def test_a_closed_gate_draws_the_memorys_row_only_on_its_read_share_and_the_rest_still_teach(smol, tmp_path):
    """``gate_read_share``: an unread question costs the vote's rows alone, gives the gate and the guard nothing,
    and still teaches the memory; measured, it draws the memory's row for the evaluation and decides the same."""
    from elm_memory.graph.nodes import answer_params
    from elm_memory.graph.stream_turn import STREAM, StreamTurn
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    script = Script(smol, memory="\\boxed{7}", zero="\\boxed{5}")
    cfg = _amortized(tmp_path, gate_read_share=0.5, guard_window=2)
    questions = [f"What is {i} + 9?" for i in range(40)]
    unread = [q for q in questions if not is_probe(q, cfg.training.seed, 0.5)]
    read = [q for q in questions if is_probe(q, cfg.training.seed, 0.5)]
    assert unread and read
    vote_tokens = 3 * _tokens(script, "\\boxed{5}") + _tokens(script, "\\boxed{6}")  # zero-shot and the samples
    with _elm(smol, cfg, script) as elm:
        stream = elm.services().stream_memory("default")
        script.calls.clear()
        skipped = elm.answer(unread[0])
        assert script.calls == [1, 3]  # zero-shot's row, then the samples: no memory row
        assert skipped.answer == "5" and skipped.stream_turn["tokens"] == vote_tokens
        assert skipped.stream_update["gate"] is None and skipped.stream_update["applied"]  # taught, not read
        assert stream.guard.pending == [] and stream.gate.readings == 0
        counted = elm.answer(read[0])
        assert counted.stream_turn["tokens"] == vote_tokens + _tokens(script, "\\boxed{7}")
        assert counted.stream_update["gate"]["outcome"] == "loss" and len(stream.guard.pending) == 1
        svc = elm.services()
        sampler = ConsistencyVerifier.from_config(cfg, script)
        prompt = svc.prompts.answer_prompt(unread[1], memory_tokens=cfg.memory.num_tokens)
        params = answer_params(cfg, prompt, script.info.max_context)
        turns = []
        for measure in (False, True):
            turn = StreamTurn.plan(cfg, stream, unread[1], "default", measure=measure)
            requests, greedy = turn.requests(cfg, stream, prompt, params, sampler)
            turn.read(script_generate(script, requests), greedy)
            turns.append(turn)
    plain, measured = turns
    assert (plain.answer, plain.mode, plain.tokens) == (measured.answer, measured.mode, measured.tokens)
    assert STREAM not in plain.rows and not measured.rows[STREAM].spent  # drawn for the evaluation alone
    assert measured.row_tokens()["stream_greedy"] == _tokens(script, "\\boxed{7}")


def script_generate(script, requests):
    from elm_memory.backends.base import generate_requests

    return generate_requests(script, requests)


# -- versions: the log, pinning, failures ----------------------------------------------------------------
def _agreeing_rows(smol):
    """Zero-shot's greedy answer and two samples, all boxing 5: a clear vote to learn from."""
    from elm_memory.training.stream_samples import Generated

    ids = smol.tokenizer("\\boxed{5}", add_special_tokens=False)["input_ids"]
    return [Generated(ids, "5", sampled=i > 0) for i in range(3)]


def test_a_long_history_stays_out_of_the_version_header_and_reads_back(smol, tmp_path):
    from elm_memory.store.stream_files import list_streams
    from elm_memory.training.stream import StreamMemory

    cfg = _amortized(tmp_path)
    stream = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    synthetic = [
        {"version": -1 - i, "question_hash": f"{i:064x}", "label": "5", "label_share": 0.8} for i in range(20000)
    ]
    stream.files.append_history(synthetic)  # twenty thousand earlier updates, about 2 MB of log
    rows = _agreeing_rows(smol)
    update = stream.learn("What is 2 + 3?", [1, 2, 3], 3, rows, label="5", version_used=0, zero_shot_answer="5")
    assert update.applied and update.version == 1
    header = int.from_bytes(stream.files.path(1).read_bytes()[:8], "little")
    assert header < 64 * 1024  # the version holds its own entry, not twenty thousand
    again = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")  # another process reads it all back
    assert len(again.history) == 20001 and again.history[-1]["question"] == "What is 2 + 3?"
    [row] = list_streams(tmp_path / "s")
    assert row["updates"] == 20001 and row["version"] == 1


def test_a_crash_between_the_pointer_and_the_log_loses_no_entry(smol, tmp_path):
    from elm_memory.training.stream import StreamMemory

    cfg = _amortized(tmp_path)
    stream = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    rows = _agreeing_rows(smol)
    stream.learn("q", [1, 2, 3], 3, rows, label="5", version_used=0, zero_shot_answer="5")
    log = stream.files.dir / "history.jsonl"
    log.write_bytes(log.read_bytes()[:-7])  # the last line cut short, as a crash mid-append leaves it
    again = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    assert [h["version"] for h in again.history] == [1]  # restored from the serving version's own header


def test_the_approved_version_survives_pruning(smol, tmp_path):
    from elm_memory.training.stream import StreamMemory

    cfg = _amortized(tmp_path, keep_versions=2, gate_min_questions=1)
    stream = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    rows = _agreeing_rows(smol)
    for i in range(8):
        stream.learn(
            f"q{i}",
            [1, 2, 3],
            3,
            rows,
            label="5",
            version_used=stream.version,
            zero_shot_answer="6",
            served_answers=["5"],
            gate_reading=_win(),
        )
    approved = stream.gate.approved_version
    assert stream.gate.state == SERVING and approved is not None and approved < stream.version - 2
    assert approved in stream.files.versions() and len(stream.files.versions()) <= 4


def test_a_non_finite_update_never_serves_and_the_gate_still_reads_the_question(smol, tmp_path, monkeypatch):
    from elm_memory.training.stream import StreamMemory

    cfg = _amortized(tmp_path)
    stream = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    before = {n: p.detach().clone() for n, p in stream.params.items()}

    def poisoned(self, *args, **kwargs):
        for p in self.params.values():
            p.grad = torch.full_like(p, float("nan"))
        return 0.0

    monkeypatch.setattr(StreamMemory, "_backward", poisoned)
    rows = _agreeing_rows(smol)
    update = stream.learn(
        "q",
        [1, 2, 3],
        3,
        rows,
        label="5",
        version_used=0,
        zero_shot_answer="6",
        served_answers=["5"],
        gate_reading=_win(),
    )
    assert update.skipped == "non_finite" and stream.version == 0 and stream.files.versions() == [0]
    assert all(torch.equal(before[n], p.detach()) for n, p in stream.params.items())
    assert update.gate["outcome"] == "win" and stream.files.read_gate()["total_readings"] == 1


def test_margin_weights_the_step_through_the_learning_rate(smol, tmp_path):
    from elm_memory.training.stream import StreamMemory

    moved = []
    for margin in (1.0, 0.2):
        cfg = _amortized(tmp_path / str(margin))
        stream = StreamMemory(cfg, smol, tmp_path / str(margin) / "s", namespace="ns")
        rows = _agreeing_rows(smol)
        stream.learn("q", [1, 2, 3], 3, rows, label="5", version_used=0, zero_shot_answer="5", margin=margin)
        moved.append(stream.moved())
        assert stream.history[-1]["label_margin"] == margin
    assert moved[1] < 0.5 * moved[0]  # a 0.2-margin label moves the memory far less than a unanimous one


# -- the evaluation method -------------------------------------------------------------------------
@pytest.mark.model
def test_elm_amortized_records_every_row_with_its_tokens_and_reports_them(tiny_loaded, tiny_backend, tmp_path):
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.online import run_stream
    from elm_memory.eval.records import RecordLog

    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "store": {"path": str(tmp_path / "store")},
            "learner": {"mode": "off"},
            "verifier": {"name": "consistency", "consistency_samples": 2},
            "generation": {"max_new_tokens": 24},
            "stream": {
                "mode": "stream",
                "serving": "amortized",
                "tuning": {"objective": "sft", "learn_from": "zero_shot"},
            },
        },
    )
    problems = load_problems("synth-arith", limit=2, seed=17)
    runtime = EvalRuntime(cfg, tmp_path, loaded=tiny_loaded, backend=tiny_backend)
    run_stream(
        problems, ["elm_amortized"], cfg, tmp_path, dataset="synth-arith", seed=17, runtime=runtime, progress=False
    )
    records = RecordLog(tmp_path / "records.jsonl").read()
    assert [r["index"] for r in records] == [0, 1]
    extra = records[0]["extra"]["amortized"]
    assert set(extra["rows"]) == {"zero_shot", "self_consistency", "stream_greedy", "init_greedy", "elm_amortized"}
    assert extra["turn"]["mode"] == "self_consistency" and extra["turn"]["gate"] == WARMUP
    # the soft prompt's untrained row is drawn for the measurement, not spent: ELM's tokens are its four rows
    tokens = extra["tokens"]
    assert tokens["elm_amortized"] == tokens["self_consistency"] + tokens["stream_greedy"]
    assert extra["gate_extra_tokens"] == tokens["stream_greedy"] and "update" in extra
    comparisons = json.loads((tmp_path / "comparisons.json").read_text())
    assert comparisons["amortized"]["parts"]["all"]["answers"] == 2
    assert (tmp_path / "amortized.png").exists()
    assert "Amortized stream memory" in (tmp_path / "results.md").read_text()


def _evaluation(smol, cfg, script, out):
    from elm_memory.eval.methods.amortized_method import AmortizedEval
    from elm_memory.eval.methods.base import EvalRuntime

    return AmortizedEval(EvalRuntime(cfg, out, loaded=smol, backend=script))


def _record(method, question, index):
    output = method.answer(question, index)
    method.learn(question, f"q{index}", output)
    return {"index": index, "question": question, "extra": output.extra}


def test_a_resumed_evaluation_reads_a_question_stopped_mid_update_once(smol, tmp_path, monkeypatch):
    # stopped while learning question 2: the gate had read it, its update and record were never written; the resumed
    # run answers it again, so the gate must be back where question 1's record left it, or it reads question 2 twice
    from elm_memory.training.stream import StreamMemory

    cfg, script = _amortized(tmp_path), Script(smol)
    first = _evaluation(smol, cfg, script, tmp_path)
    records = [_record(first, "What is 2 + 3?", 0)]
    assert records[0]["extra"]["amortized"]["gate_state"]["total_readings"] == 1

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(StreamMemory, "_update", stopped)
        with pytest.raises(KeyboardInterrupt):
            _record(first, "What is 4 + 1?", 1)
    assert first.stream.files.read_gate()["total_readings"] == 2  # read, not recorded
    version = first.stream.version

    again = _evaluation(smol, cfg, script, tmp_path)
    again.resume(records)
    gate = again.stream.files.read_gate()
    assert gate == records[0]["extra"]["amortized"]["gate_state"] and again.stream.gate.total_readings == 1
    assert again.stream.version == version  # no update was written: the version is the recorded one
    assert again.stream.history[-1]["gate_restored"]["readings"] == [2, 1]
    from elm_memory.cli.memory_views import stream_lines
    from elm_memory.store.stream_files import list_streams

    lines = stream_lines(list_streams(again.stream.files.dir.parent))
    assert any("gate put back: warmup -> warmup, 2 -> 1 readings (resume:" in line for line in lines), lines
    records.append(_record(again, "What is 4 + 1?", 1))
    assert again.stream.files.read_gate()["total_readings"] == 2  # question 2 read once
    again.resume(records)  # nothing unrecorded: nothing restored
    assert "gate_restored" not in again.stream.history[-1]


def test_a_resumed_evaluation_puts_the_guard_back_where_its_last_record_left_it(smol, tmp_path, monkeypatch):
    # stopped after question 2 learned (the guard read it, and its readings were saved for a restarted process) but
    # before its record: the resumed run answers it again, so the guard must be back at question 1's record
    from elm_memory.training.stream import StreamMemory

    cfg, script = _amortized(tmp_path), Script(smol)
    first = _evaluation(smol, cfg, script, tmp_path)
    records = [_record(first, "What is 2 + 3?", 0)]
    recorded = records[0]["extra"]["amortized"]["pending_state"]
    assert len(recorded["guard"]["pending"]) == 1 and recorded["pooled"] == []

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(StreamMemory, "pending_state", stopped)  # learn's last step, after the turn learned
        with pytest.raises(KeyboardInterrupt):
            _record(first, "What is 4 + 1?", 1)
    held = first.stream.files.read_pending(first.stream.version)
    assert len(held["guard"]["pending"]) == 2  # read and kept, not recorded

    again = _evaluation(smol, cfg, script, tmp_path)
    assert again.stream.guard.state() == held["guard"]  # a restarted process continues from what was kept
    again.resume(records)
    assert again.stream.guard.state() == recorded["guard"]
    assert again.stream.files.read_pending(again.stream.version)["guard"] == recorded["guard"]
    records.append(_record(again, "What is 4 + 1?", 1))
    assert len(again.stream.guard.pending) == 2  # question 2 read once


def test_a_graph_resumed_from_its_checkpoint_learns_a_turn_it_stopped_in_once(smol, tmp_path, monkeypatch):
    # a graph with a checkpointer stopped inside learn_memory; resuming its thread re-runs that node, which must not
    # read the gate twice (stopped mid-update: the gate had read the turn) nor learn twice (stopped after the update)
    from langgraph.checkpoint.memory import InMemorySaver

    from elm_memory.graph import build_elm_graph
    from elm_memory.training.stream import StreamMemory

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    real_step = StreamMemory._step

    def step_then_stop(self, *args, **kwargs):
        real_step(self, *args, **kwargs)
        raise KeyboardInterrupt

    script = Script(smol, memory="\\boxed{5}", zero="\\boxed{5}")
    with _elm(smol, _amortized(tmp_path), script) as elm:
        graph = build_elm_graph(elm.services, checkpointer=InMemorySaver())
        stream = elm.services().stream_memory("default")
        for thread, stopped_in, question in [("a", "_update", "What is 2 + 3?"), ("b", "_step", "What is 1 + 4?")]:
            run = {"configurable": {"thread_id": thread}}
            readings, version = stream.gate.total_readings, stream.version
            with monkeypatch.context() as m:
                m.setattr(StreamMemory, stopped_in, stop if stopped_in == "_update" else step_then_stop)
                with pytest.raises(KeyboardInterrupt):
                    graph.invoke({"question": question}, run)
            assert stream.files.read_gate()["total_readings"] == readings + 1
            assert graph.get_state(run).next == ("learn_memory",)
            update = graph.invoke(None, run)["stream_update"]  # the resumed thread re-runs learn_memory
            assert stream.files.read_gate()["total_readings"] == readings + 1  # read once
            if stopped_in == "_update":  # the update never ran: it runs now, the gate's reading shown, not read again
                assert update["applied"] and update["gate"]["read_already"] and stream.version == version + 1
            else:  # the version was written before the stop: nothing more to learn
                assert update["skipped"] == "learned_already" and stream.version == version + 1
    assert [h.get("turn") is not None for h in stream.history if "label" in h] == [True, True]


def test_a_resume_from_records_without_the_gates_state_says_when_the_gate_holds_more(smol, tmp_path, caplog):
    cfg, script = _amortized(tmp_path), Script(smol)
    first = _evaluation(smol, cfg, script, tmp_path)
    records = [_record(first, "What is 2 + 3?", 0)]
    _record(first, "What is 4 + 1?", 1)  # read and learned, its record lost
    for r in records:
        del r["extra"]["amortized"]["gate_state"]  # written before records held it
    again = _evaluation(smol, cfg, script, tmp_path)
    with caplog.at_level("WARNING", logger="elm_memory.eval.methods.amortized_method"):
        again.resume(records)
    assert "the gate holds 2 readings but the records 1" in caplog.text


def test_two_learners_of_one_namespace_share_the_gate(smol, tmp_path):
    from elm_memory.training.stream import StreamMemory
    from elm_memory.training.stream_samples import Generated

    cfg = _amortized(tmp_path)
    a = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")
    b = StreamMemory(cfg, smol, tmp_path / "s", namespace="ns")  # another process's
    ids = smol.tokenizer("\\boxed{5}", add_special_tokens=False)["input_ids"]
    weak = [Generated(ids, a_, sampled=i > 0) for i, a_ in enumerate(["5", "6", "7", "8"])]  # no clear vote
    for learner in (a, b, a):
        update = learner.learn(
            "q",
            [1, 2, 3],
            3,
            weak,
            label="5",
            version_used=0,
            zero_shot_answer="6",
            served_answers=["5"],
            gate_reading=_win(),
        )
        assert update.skipped == "weak_label" and learner.version == 0  # no new version for the other to see
    assert a.files.read_gate()["total_readings"] == 3 and a.gate.wins == 3  # no reading lost between them


def test_amortized_serving_refuses_the_retrieved_memorys_vote():
    with pytest.raises(ConfigError, match="stream.mode=stream"):
        ELMConfig.load(preset="cpu-amortized", overrides={"stream": {"mode": "both"}})
