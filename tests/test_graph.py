"""The ELM graph on real packaged weights: routes, namespaces, embedding, config swaps, learner."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elm_memory.config import ELMConfig
from elm_memory.elm import ELM
from elm_memory.graph import ELMRunContext, build_elm_graph

pytestmark = pytest.mark.model

Q1 = "Tom has 3 apples and buys 4 more. How many apples does he have?"
Q2 = "Tom has 3 pears and buys 4 more. How many pears does he have?"


def tiny_config(tmp_path, **overrides) -> ELMConfig:
    base = {
        "model": {"dtype": "float32"},
        "store": {"path": str(tmp_path / "store")},
        "training": {"steps": 0},  # untrained memories: fast, the graph is what is tested here
        "retrieval": {"skip_no_consensus": False},  # SmolLM2 never answers, so its memories have no consensus
    }
    for key, value in overrides.items():
        base.setdefault(key, {}).update(value)
    return ELMConfig.load(preset="cpu-tiny", overrides=base)


@pytest.fixture()
def tiny_elm(tmp_path, tiny_loaded, tiny_backend):
    elm = ELM(tiny_config(tmp_path), loaded=tiny_loaded, backend=tiny_backend)
    yield elm
    elm.close()


class FixedVerifier:
    name = "fixed"

    def __init__(self, scores):
        self.scores, self.calls = scores, 0

    def score(self, question, responses):
        self.calls += 1
        return list(self.scores)


def test_first_question_has_no_memory_then_memory_is_retrieved(tiny_elm):
    first = tiny_elm.answer(Q1)
    assert first.route == "zero_shot" and first.memory_id is None and len(first.candidates) == 1
    assert first.learn_job is not None and first.learn_job["status"] == "done"  # sync learner: paper protocol
    assert tiny_elm.retriever.store.count("default") == 1
    second = tiny_elm.answer(Q2)
    assert second.memory_id == first.learn_job["memory_id"] and second.similarity > 0.9
    assert [c["kind"] for c in second.candidates] == ["zero_shot", "memory"]
    assert second.timings["dual_generate"] > 0 and second.timings["total"] >= second.timings["dual_generate"]


def test_verifier_route_picks_the_higher_score(tiny_elm):
    tiny_elm.answer(Q1)
    tiny_elm._services = None
    tiny_elm._verifier = FixedVerifier([0.1, 0.9])
    r = tiny_elm.answer(Q2, learn=False)
    # SmolLM2 writes no \boxed{}: None vs None never "agree", so the verifier decides.
    assert r.route == "verifier" and tiny_elm.verifier.calls == 1
    assert r.timings["verify"] > 0 and r.timings["total"] >= r.timings["verify"]  # its own node
    assert [c["score"] for c in r.candidates] == [0.1, 0.9]
    assert r.response == r.candidates[1]["response"]
    tiny_elm._services = None
    tiny_elm._verifier = FixedVerifier([0.5, 0.5])  # tie: the zero-shot answer is kept
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "verifier" and r.response == r.candidates[0]["response"]


def test_namespaces_are_hard_filters(tiny_elm):
    tiny_elm.answer(Q1, namespace="team-a")
    other = tiny_elm.answer(Q2, namespace="team-b", learn=False)
    same = tiny_elm.answer(Q2, namespace="team-a", learn=False)
    assert other.memory_id is None and other.route == "zero_shot"
    assert same.memory_id is not None


def test_failures_degrade_to_zero_shot_with_a_warning(tiny_elm, monkeypatch):
    tiny_elm.answer(Q1)
    tiny_elm._services = None

    def broken(*args, **kwargs):
        raise RuntimeError("verifier exploded")

    tiny_elm._verifier = FixedVerifier([0, 0])
    monkeypatch.setattr(tiny_elm._verifier, "score", broken)
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "verifier" and r.response == r.candidates[0]["response"]
    assert any("verifier failed" in w for w in r.warnings)
    monkeypatch.setattr(
        tiny_elm.retriever, "retrieve_with_gates", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down"))
    )
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "zero_shot" and any("retrieval failed" in w for w in r.warnings)


def test_agree_route_on_the_default_model(tmp_path, default_loaded, default_backend):
    cfg = ELMConfig.load(
        preset="cpu-demo",
        overrides={
            "store": {"path": str(tmp_path / "s")},
            "training": {"steps": 0},
            "generation": {"max_new_tokens": 200},
            "verifier": {"route": "verify"},  # the preset votes; this test is about the paper's route
        },
    )
    with ELM(cfg, loaded=default_loaded, backend=default_backend) as elm:
        elm.learn("Tom has 3 apples and buys 4 more. How many apples does he have now?")
        r = elm.answer("Sam has 2 apples and buys 5 more. How many apples does he have now?", learn=False)
    assert r.memory_id is not None and r.candidates[0]["answer"] == "7"
    if r.candidates[1]["answer"] == "7":
        assert r.route == "agree" and r.answer == "7"
    else:  # a memory may hijack a small model: then the verifier must have decided
        assert r.route == "verifier" and r.candidates[0]["score"] is not None


def test_elm_graph_as_a_subgraph_of_a_parent_agent(tiny_elm):
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class Parent(TypedDict, total=False):
        question: str
        answer: str | None
        route: str
        log: list[str]

    def plan(state: Parent) -> Parent:
        return {"log": ["planned"]}

    def report(state: Parent) -> Parent:
        return {"log": [*state["log"], f"route={state['route']}"]}

    parent = StateGraph(Parent, context_schema=ELMRunContext)
    parent.add_node("plan", plan)
    parent.add_node("solve", tiny_elm.graph)  # the compiled ELM graph as a node
    parent.add_node("report", report)
    parent.add_edge(START, "plan")
    parent.add_edge("plan", "solve")
    parent.add_edge("solve", "report")
    parent.add_edge("report", END)
    out = parent.compile().invoke({"question": Q1}, context={"namespace": "parent-ns", "learn": False})
    assert out["log"] == ["planned", "route=zero_shot"] and "answer" in out
    assert tiny_elm.retriever.store.count("parent-ns") == 0  # learn=False came through the context


def test_state_survives_a_checkpointer_and_each_run_starts_a_fresh_trace(tiny_elm):
    from langgraph.checkpoint.memory import InMemorySaver

    graph = build_elm_graph(tiny_elm.services(), checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t1"}}
    graph.invoke({"question": Q1}, cfg)
    saved = graph.get_state(cfg).values
    assert saved["question"] == Q1 and saved["route"] == "zero_shot" and "timings" in saved
    assert saved["learn_job"]["status"] == "done"
    tiny_elm.retriever.retrieve_with_gates = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down"))
    graph.invoke({"question": Q2, "learn": False}, cfg)
    second = graph.get_state(cfg).values
    # reducers: this run's warning only, timings of this run, no learn job carried over
    assert second["question"] == Q2 and second["learn_job"] is None
    assert len(second["warnings"]) == 1 and "retrieval failed" in second["warnings"][0]
    assert set(second["timings"]) == {"retrieve", "dual_generate", "route", "total"}


def test_run_context_selects_the_namespace_and_refuses_unknown_keys(tmp_path, tiny_loaded, tiny_backend):
    from elm_memory.errors import ConfigError

    cfg = tiny_config(tmp_path)
    cfg = cfg.model_copy(update={"namespace_template": "user-{user_id}"})
    with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend) as elm:
        ada = elm.answer(Q1, context={"user_id": "ada"})
        assert ada.namespace == "user-ada" and elm.retriever.store.count("user-ada") == 1
        bob = elm.answer(Q2, context={"user_id": "bob"}, learn=False)
        assert bob.namespace == "user-bob" and bob.memory_id is None  # ada's memory is not bob's
        again = elm.answer(Q2, context={"user_id": "ada"}, learn=False)
        assert again.memory_id == ada.learn_job["memory_id"]
        assert elm.answer(Q2, namespace="explicit", context={"user_id": "ada"}, learn=False).namespace == "explicit"
        with pytest.raises(ConfigError, match="user_id"):
            elm.answer(Q2, learn=False)  # the template needs user_id and the run has none
        with pytest.raises(Exception, match="colour"):
            elm.answer(Q2, context={"user_id": "ada", "colour": "red"}, learn=False)
        assert elm.retriever.store.count("user-ada") == 1 and elm.retriever.store.count("user-bob") == 0


def test_config_swap_by_yaml_only(tmp_path, tiny_loaded, tiny_backend):
    path = tmp_path / "elm.yaml"
    path.write_text(
        "model: {name_or_path: 'packaged:smollm2-135m', dtype: float32}\n"
        f"store: {{path: '{tmp_path / 'kvstore'}'}}\n"
        "retrieval: {key: kv, skip_no_consensus: false}\n"
        "verifier: {name: logprob}\n"
        "training: {steps: 0}\n"
    )
    cfg = ELMConfig.load(path, preset="cpu-tiny")
    with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend) as elm:
        assert type(elm.verifier).__name__ == "LogprobVerifier"
        assert elm.retriever.kind == "kv"
        elm.answer(Q1)
        r = elm.answer(Q2, learn=False)
        assert r.memory_id is not None and r.route == "verifier"
        assert all(c["score"] is not None for c in r.candidates)


def test_background_learning_never_blocks_and_resumes_after_restart(tmp_path, tiny_loaded, tiny_backend):
    cfg = tiny_config(tmp_path, learner={"mode": "background"}, training={"steps": 1, "num_generations": 2})
    elm = ELM(cfg, loaded=tiny_loaded, backend=tiny_backend)
    gate = threading.Event()
    real_learn = elm.learn

    def slow_learn(*args, **kwargs):
        gate.wait(300)
        return real_learn(*args, **kwargs)

    # the worker blocks until we open the gate, so an answer that waited for learning would take the
    # gate's whole 300 s and find its job done; a wall-clock bound near the answer's own time (it was
    # 30 s) failed on a loaded machine, where answering alone took 42-44 s
    elm.learn = slow_learn
    t0 = time.perf_counter()
    r = elm.answer(Q1)
    assert r.learn_job["status"] in {"pending", "running"}  # returned before learning
    assert time.perf_counter() - t0 < 300
    elm.close(wait=False)  # "restart": the job is still pending/running
    gate.set()
    restarted = ELM(cfg, loaded=tiny_loaded, backend=tiny_backend)
    assert restarted.learner.wait(timeout=120)
    restarted.close()
    again = ELM(cfg, loaded=tiny_loaded, backend=tiny_backend)
    assert again.retriever.store.count("default") == 1
    assert again.learner.job(r.learn_job["job_id"]).state == "done"
    again.close()


@pytest.mark.slow
@pytest.mark.extended
def test_16_concurrent_answers_with_background_learning(tmp_path, tiny_loaded, tiny_backend):
    cfg = tiny_config(tmp_path, learner={"mode": "background"}, training={"steps": 1, "num_generations": 2})
    questions = [f"What is {i} plus {i + 1}?" for i in range(16)]
    results: dict[int, object] = {}
    with ELM(cfg, loaded=tiny_loaded, backend=tiny_backend) as elm:
        elm.services()

        def ask(i: int) -> None:
            results[i] = elm.answer(questions[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(results) == 16 and all(r.response is not None for r in results.values())
        assert elm.learner.wait(timeout=600)
        store = elm.retriever.store
        assert store.count("default") == 16
        ids = {r.learn_job["memory_id"] or r.learn_job["job_id"] for r in results.values()}
        assert len(ids) == 16
        assert {m.id for m in store.list("default")} == ids
    assert torch.get_num_threads() >= 1


def test_prefer_answered_routes_to_the_candidate_with_an_answer(tiny_elm):
    tiny_elm.answer(Q1)
    services = tiny_elm.services()
    cfg = tiny_elm.config.model_copy(
        update={"verifier": tiny_elm.config.verifier.model_copy(update={"prefer_answered": True})}
    )
    services.config = cfg
    services.verifier = FixedVerifier([0.9, 0.1])  # would keep zero-shot
    real_generate = services.backend.generate

    def memory_answers(inputs, params):  # SmolLM2 never boxes: give the memory candidate an answer
        out = real_generate(inputs, params)
        if len(out) == 2:
            [gen] = out[1]
            out[1] = [type(gen)(**{**gen.__dict__, "text": gen.text + " \\boxed{7}"})]
        return out

    services.backend = type("B", (), {"generate": staticmethod(memory_answers), "info": services.backend.info})()
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "answered" and r.answer == "7" and services.verifier.calls == 0
    assert "verify" not in r.timings


class ScriptedBackend:
    """The tiny backend's tokenizer and info, with scripted texts (SmolLM2 never boxes): greedy answers box
    3 without a memory and 7 with one, samples box 7, 7, 7, 3. Records each call's requests."""

    def __init__(self, inner, batches_calls=True):
        self.info, self.tokenizer, self.batches_calls = inner.info, inner.tokenizer, batches_calls
        self.calls, self.budgets = [], []

    def generate(self, prompts, params):
        return self.generate_many([(prompts, params)])[0]

    def generate_many(self, requests):
        from elm_memory.backends.base import Generation

        self.calls.append([(len(prompts), params.n) for prompts, params in requests])
        self.budgets.append([params.max_new_tokens for _, params in requests])
        out = []
        for prompts, params in requests:
            if params.greedy:
                texts = [["\\boxed{7}" if p.soft_prompt is not None else "\\boxed{3}"] for p in prompts]
            else:  # one row per sample (n = 1): rows box 7, 7, 7, 3
                texts = [[("\\boxed{7}", "\\boxed{7}", "\\boxed{7}", "\\boxed{3}")[i % 4]] for i in range(len(prompts))]
            out.append([[Generation(t, [1], "answer") for t in row] for row in texts])
        return out


@pytest.mark.parametrize(("presample", "batches_calls"), [(True, True), (False, True), (True, False)])
def test_consistency_samples_join_the_answers_call_when_presampling(tiny_elm, presample, batches_calls):
    """presample on a backend that batches calls: the samples come in the candidates' call and a
    disagreement is scored without another; otherwise they are drawn after the disagreement. Same route,
    same scores either way; no memory, no samples."""
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    tiny_elm.answer(Q1)  # a memory to retrieve
    services = tiny_elm.services()
    backend = ScriptedBackend(services.backend, batches_calls=batches_calls)
    services.backend = backend
    answers_budget = tiny_elm.config.generation.max_new_tokens
    services.verifier = ConsistencyVerifier(backend, samples=4, presample=presample, max_new_tokens=answers_budget + 5)
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "verifier" and r.answer == "7" and [c["score"] for c in r.candidates] == [0.25, 0.75]
    assert r.verifier_sample_answers == ["7", "7", "7", "3"]  # what was scored, drawn ahead or after
    if presample and batches_calls:
        assert backend.calls == [[(2, 1), (4, 1)]]  # one call: both answers and the four sample rows
        assert backend.budgets == [[answers_budget, answers_budget]]  # cut to the answers' budget
    else:
        assert backend.calls == [[(2, 1)], [(4, 1)]]
        assert backend.budgets == [[answers_budget], [answers_budget + 5]]
    backend.calls.clear()
    first = tiny_elm.answer(Q1, namespace="empty", learn=False)
    assert first.route == "zero_shot" and backend.calls == [[(1, 1)]]


class TiedSamplesBackend(ScriptedBackend):
    """ScriptedBackend whose first samples tie the two answers (one 7, one 3, two 9s); a later sample call
    (the tie call: rows with the seeds of the next sample indices) boxes 7 on every sample."""

    def generate_many(self, requests):
        from elm_memory.backends.base import Generation

        out = super().generate_many(requests)
        for i, (prompts, params) in enumerate(requests):
            if not params.greedy:
                texts = ["\\boxed{7}", "\\boxed{3}", "\\boxed{9}", "\\boxed{9}"]
                if prompts[0].seed not in self.first_seeds:
                    texts = ["\\boxed{7}"] * len(prompts)
                out[i] = [[Generation(t, [1], "answer")] for t in texts]
        return out


@pytest.mark.parametrize("tie_samples", [0, 8])
def test_a_tie_draws_more_samples_and_counts_them_all(tiny_elm, tie_samples):
    """consistency_tie_samples: the samples drawn with the answers tie them (1 of 4 each); with tie samples
    set, eight more are drawn in one call with the next seed and the memory's 7 wins 9/12 to 1/12; without,
    the tie keeps zero-shot and nothing more is drawn."""
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    tiny_elm.answer(Q1)
    services = tiny_elm.services()
    backend = TiedSamplesBackend(services.backend)
    services.backend = backend
    services.verifier = ConsistencyVerifier(backend, samples=4, seed=5, tie_samples=tie_samples)
    backend.first_seeds = set(services.verifier.sample_seeds(Q2))
    r = tiny_elm.answer(Q2, learn=False)
    scores = [c["score"] for c in r.candidates]
    if tie_samples:
        assert r.answer == "7" and scores == [1 / 12, 9 / 12]
        assert backend.calls == [[(2, 1), (4, 1)], [(8, 1)]]
        assert r.verifier_sample_answers == ["7", "3", "9", "9"] + ["7"] * 8  # the result shows the cost
    else:
        assert r.answer == "3" and scores == [0.25, 0.25]
        assert backend.calls == [[(2, 1), (4, 1)]]
        assert r.verifier_sample_answers == ["7", "3", "9", "9"]


class VotingSamplesBackend(ScriptedBackend):
    """ScriptedBackend (greedy: 3 without a memory, 7 with one) whose four samples box ``sample_answers``,
    each sample's text naming its row so a response can be traced to the sample it came from."""

    sample_answers = ("7", "7", "7", "3")

    def generate_many(self, requests):
        from elm_memory.backends.base import Generation

        out = super().generate_many(requests)
        for i, (prompts, params) in enumerate(requests):
            if not params.greedy:
                picks = [self.sample_answers[j % 4] for j in range(len(prompts))]
                out[i] = [[Generation(f"sample {j}: \\boxed{{{a}}}", [1], "answer")] for j, a in enumerate(picks)]
        return out


def _voting(tiny_elm, sample_answers, batches_calls=True):
    from elm_memory.verifiers.consistency import ConsistencyVerifier

    services = tiny_elm.services()
    services.config = tiny_elm.config.model_copy(
        update={"verifier": tiny_elm.config.verifier.model_copy(update={"route": "vote"})}
    )
    backend = VotingSamplesBackend(services.backend, batches_calls=batches_calls)
    backend.sample_answers = sample_answers
    services.backend = backend
    services.verifier = ConsistencyVerifier(backend, samples=4)
    return backend


@pytest.mark.parametrize(
    ("sample_answers", "answer", "response"),
    [
        (("7", "7", "7", "3"), "7", "\\boxed{7}"),  # 4 votes (3 samples + memory) to 2: the memory's text
        (("9", "9", "9", "3"), "9", "sample 0: \\boxed{9}"),  # neither candidate: the first 9 sample's text
        (("7", "3", "9", "9"), "3", "\\boxed{3}"),  # 2-2-2: the tie goes to zero-shot
        (("9", "9", "7", "5"), "9", "sample 0: \\boxed{9}"),  # 9 ties 7 (sample + memory): 9 was counted first
    ],
)
@pytest.mark.parametrize("batches_calls", [True, False])
def test_vote_route_counts_zero_shot_the_samples_and_the_memory(
    tiny_elm, sample_answers, answer, response, batches_calls
):
    """verifier.route=vote: the answer is the majority of zero-shot (3), the four samples and the memory (7),
    ties to zero-shot, else to the answer counted first; the response is the text that gave it. The samples
    come in the answers' call where the backend batches calls, in a call of their own otherwise."""
    tiny_elm.answer(Q1)  # a memory to retrieve
    backend = _voting(tiny_elm, sample_answers, batches_calls)
    r = tiny_elm.answer(Q2, learn=False)
    assert r.route == "vote" and r.answer == answer and r.response == response
    assert r.verifier_sample_answers == list(sample_answers)
    assert [c["score"] for c in r.candidates] == [sample_answers.count("3") / 4, sample_answers.count("7") / 4]
    assert backend.calls == ([[(2, 1), (4, 1)]] if batches_calls else [[(2, 1)], [(4, 1)]])


def test_vote_route_without_a_memory_is_self_consistency(tiny_elm):
    """No memory retrieved: the vote still counts the samples, so the answer is self-consistency's (7 from
    three samples against greedy's 3), not greedy's."""
    backend = _voting(tiny_elm, ("7", "7", "7", "3"))
    r = tiny_elm.answer(Q1, namespace="empty", learn=False)
    assert r.route == "vote" and r.answer == "7" and r.memory_id is None
    assert backend.calls == [[(1, 1), (4, 1)]]


def test_vote_route_needs_a_sampling_verifier(tmp_path):
    from elm_memory.errors import ConfigError

    with pytest.raises(ConfigError, match="verifier.route=vote"):
        tiny_config(tmp_path, verifier={"name": "self_certainty", "route": "vote"})
