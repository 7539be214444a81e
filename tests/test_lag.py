"""The LAG baseline (``lag``, ``lag_tts``: elm_memory/eval/methods/lag.py) and the KV-prefix generation
under it (elm_memory/models/kv_prefix.py), on the real tiny model (SmolLM2-135M, cpu-tiny preset)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from elm_memory.backends.base import Generation, PromptInput, SamplingParams
from elm_memory.backends.kv_prefix import KVPrefix, encode_prefix, generate_after_prefix, load_prefix, save_prefix
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import load_problems
from elm_memory.errors import ConfigError, IncompatibleMemoryError, MemoryFormatError
from elm_memory.eval.methods.base import EvalRuntime, build_method
from elm_memory.eval.records import RecordLog

pytestmark = pytest.mark.model

NEW_TOKENS = 12


def tiny_config(**over: Any) -> ELMConfig:
    return ELMConfig.load(preset="cpu-tiny", overrides={"generation": {"max_new_tokens": NEW_TOKENS}, **over})


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- generation after a KV prefix -------------------------------------------------------------


def test_generation_after_a_kv_prefix_equals_generation_after_its_tokens_written_out(smol, tiny_backend, tmp_path):
    tok = smol.tokenizer
    log = ids(tok, "The secret code of the blue door is 4817. The blue door opens with code 4817.\n\n")
    prompt = ids(tok, "The secret code of the blue door is")
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    [[written]] = tiny_backend.generate([PromptInput(tuple(log + prompt))], params)
    [[plain]] = tiny_backend.generate([PromptInput(tuple(prompt))], params)

    path = save_prefix(encode_prefix(smol.model, log), tmp_path / "log.safetensors", fingerprint=smol.info.fingerprint)
    prefix = load_prefix(path, smol.info)
    assert prefix.token_ids == tuple(log) and len(prefix.keys) == smol.info.num_layers
    after = generate_after_prefix(
        smol.model, tok, prefix, prompt, max_new_tokens=NEW_TOKENS, eos_ids=tiny_backend.eos_ids
    )
    assert after.token_ids == written.token_ids and after.finish_reason == written.finish_reason
    assert "4817" in after.text and "4817" not in plain.text  # the prefix is read, not ignored

    # an empty prefix is plain greedy decoding, token for token
    empty = generate_after_prefix(
        smol.model, tok, KVPrefix.empty(), prompt, max_new_tokens=NEW_TOKENS, eos_ids=tiny_backend.eos_ids
    )
    assert len(plain.token_ids) >= 8 and empty.token_ids == plain.token_ids


def test_a_prefix_file_is_checked_against_the_model(smol, tmp_path):
    import torch

    prefix = encode_prefix(smol.model, ids(smol.tokenizer, "two plus two"))
    other = save_prefix(prefix, tmp_path / "other.safetensors", fingerprint="0123456789abcdef")
    with pytest.raises(IncompatibleMemoryError, match="fingerprint"):
        load_prefix(other, smol.info)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(MemoryFormatError, match="not a KV prefix file"):
        load_prefix(tmp_path / "junk.safetensors", smol.info)
    poisoned = dataclasses.replace(prefix, keys=[k.clone() for k in prefix.keys])
    poisoned.keys[3][0, 0, 0] = float("nan")
    bad = save_prefix(poisoned, tmp_path / "nan.safetensors", fingerprint=smol.info.fingerprint)
    with pytest.raises(MemoryFormatError, match="layer.3.key must be finite"):
        load_prefix(bad, smol.info)
    assert torch.equal(
        load_prefix(
            save_prefix(prefix, tmp_path / "ok.safetensors", fingerprint=smol.info.fingerprint), smol.info
        ).values[3],
        prefix.values[3],
    )


# ---- the lag method ---------------------------------------------------------------------------


def test_the_pool_grows_by_one_log_per_question_and_a_resumed_run_rereads_it(smol, tiny_backend, tmp_path, monkeypatch):
    import elm_memory.eval.methods.lag as lag_module

    cfg = tiny_config()
    rt = EvalRuntime(cfg, tmp_path, loaded=smol, backend=tiny_backend)
    p0, p1, p2 = load_problems("synth-arith", limit=3, seed=17)
    method: Any = build_method("lag", rt)

    first = method.answer(p0.question, 0)
    assert first.route == "zero_shot" and first.memory_id is None and method.pool_stats()[0] == 0
    method.learn(p0.question, p0.id, first)
    assert method.pool_stats()[0] == 1 and method.pool_stats()[1] > 0

    second = method.answer(p1.question, 1)
    assert second.route == "context" and second.memory_id == p0.id and -1.0 <= second.similarity <= 1.0
    assert second.extra["log_question"] == p0.question and second.candidates[0]["kind"] == "context"
    # the key correctness check: the answer is what the model writes after the log's tokens written out
    pool = method.pool
    [entry] = pool.entries
    prefix = pool.load(entry)
    prompt = rt.prompts.answer_prompt(p1.question, memory_tokens=0).token_ids
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, stop_at_answer=cfg.generation.stop_at_answer)
    [[written]] = tiny_backend.generate([PromptInput(prefix.token_ids + prompt)], greedy)
    assert second.response == written.text and second.extra["log_tokens"] == prefix.length
    # the log is the first question's own exchange: its prompt, then its greedy answer
    assert prefix.token_ids[: len(rt.prompts.answer_prompt(p0.question, memory_tokens=0).token_ids)] == (
        rt.prompts.answer_prompt(p0.question, memory_tokens=0).token_ids
    )
    assert p0.question in entry["payload"] and first.response.strip() in entry["payload"]

    method.learn(p1.question, p1.id, second)
    assert method.pool_stats()[0] == 2
    index = RecordLog(pool.dir / "entries.jsonl").read()
    assert [e["question_id"] for e in index] == [p0.id, p1.id]
    assert all(set(e) == {"question_id", "question", "payload", "file"} for e in index)
    files = [pool.dir / e["file"] for e in index]
    assert all(f.suffix == ".safetensors" and f.is_file() for f in files)
    stamps = [f.stat().st_mtime_ns for f in files]

    # a resumed run finds its pool and never encodes a log again
    def no_encoding(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a resumed run recomputed a stored log")

    monkeypatch.setattr(lag_module, "encode_prefix", no_encoding)
    resumed = build_method("lag", rt)
    assert resumed.pool_stats() == method.pool_stats()
    resumed.learn(p1.question, p1.id, second)  # already logged
    third = resumed.answer(p2.question, 2)
    assert third.route == "context" and third.memory_id in (p0.id, p1.id)
    assert [f.stat().st_mtime_ns for f in files] == stamps and resumed.pool_stats()[0] == 2


def test_retrieval_returns_the_most_similar_log(smol, tiny_backend, tmp_path):
    rt = EvalRuntime(tiny_config(), tmp_path, loaded=smol, backend=tiny_backend)
    method: Any = build_method("lag", rt)
    logs = {
        "apples": "Tom has 3 apples and buys 4 more apples. How many apples does Tom have?",
        "capital": "What is the capital city of France?",
        "german": "How do you say 'cat' in German?",
    }
    for qid, question in logs.items():
        prefix = encode_prefix(smol.model, ids(smol.tokenizer, question))
        method.pool.add_log(qid, question, question, prefix, smol.info.fingerprint)
    assert method.pool.nearest("What is the capital city of Spain?")[0]["question_id"] == "capital"
    query = "Mia has 5 apples and buys 2 more apples. How many apples does Mia have?"
    entry, similarity = method.pool.nearest(query)
    assert entry["question_id"] == "apples"
    out = method.answer(query, 0)
    assert out.route == "context" and out.memory_id == "apples" and out.similarity == pytest.approx(similarity)
    assert out.extra["log_question"] == logs["apples"]


def test_a_log_that_would_overflow_the_context_is_skipped_and_recorded(smol, tmp_path):
    from elm_memory.backends.hf import HFBackend

    question = "What is 2 plus 3?"
    cfg = tiny_config()
    probe = EvalRuntime(cfg, tmp_path / "probe", loaded=smol, backend=HFBackend(smol))
    prompt_tokens = len(probe.prompts.answer_prompt(question, memory_tokens=0).token_ids)
    # room for the prompt and the answer, not for a 20-token log before them
    small = dataclasses.replace(smol, info=dataclasses.replace(smol.info, max_context=prompt_tokens + NEW_TOKENS + 5))
    rt = EvalRuntime(cfg, tmp_path, loaded=small, backend=HFBackend(small))
    method: Any = build_method("lag", rt)
    log = ids(smol.tokenizer, "One plus one is two, and two plus two is four, so sums are easy.")
    assert len(log) > 5
    method.pool.add_log("old", "What is 1 plus 1?", "log", encode_prefix(smol.model, log), small.info.fingerprint)
    out = method.answer(question, 0)
    assert out.route == "zero_shot" and out.memory_id is None and out.warnings
    assert out.extra["log_skipped"]["question_id"] == "old" and out.extra["log_skipped"]["reason"] == "context"


def test_a_backend_that_cannot_prepend_a_kv_cache_is_refused_before_any_work(tmp_path):
    rt = EvalRuntime(tiny_config(backend={"name": "vllm"}), tmp_path)
    for name in ("lag", "lag_tts"):
        with pytest.raises(ConfigError, match=rf"{name} prepends a stored KV cache.*'hf'.*'vllm'"):
            build_method(name, rt)
    assert rt._base is None and not (tmp_path / "pools").exists()  # no model loaded, no pool made


# ---- lag_tts ----------------------------------------------------------------------------------


class ScriptedSamples:
    """The tiny model's backend, except that sampled calls return scripted completions."""

    def __init__(self, backend: Any, texts: list[str]):
        self._backend = backend
        self.texts = texts
        self.sampled: list[SamplingParams] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, prompts: list[Any], params: SamplingParams) -> list[list[Generation]]:
        if params.greedy:
            return self._backend.generate(prompts, params)
        self.sampled.append(params)
        tok = self._backend.tokenizer
        return [
            [Generation(text=t, token_ids=ids(tok, t), finish_reason="stop") for t in self.texts[: params.n]]
            for _ in prompts
        ]


def test_lag_tts_logs_a_rollout_that_agrees_with_the_majority(smol, tiny_backend, tmp_path):
    texts = ["so the answer is \\boxed{3}", "first try: \\boxed{5}", "I am not sure", "again \\boxed{5}"]
    scripted = ScriptedSamples(tiny_backend, texts)
    cfg = tiny_config(training={"num_generations": 4})
    rt = EvalRuntime(cfg, tmp_path, loaded=smol, backend=scripted)
    method: Any = build_method("lag_tts", rt)
    question = "What is 2 plus 3?"
    out = method.answer(question, 0)
    method.learn(question, "q0", out)

    [params] = scripted.sampled
    assert params.n == 4 and params.temperature == cfg.training.effective_temperature(smol.info.model_type)
    vote = out.extra["log_vote"]
    assert vote == {"answers": ["3", "5", None, "5"], "majority": "5", "count": 2, "total": 4, "rollout": 1}
    [entry] = method.pool.entries
    assert "first try: \\boxed{5}" in entry["payload"] and "\\boxed{3}" not in entry["payload"]
    # the stored KV is that very log
    assert smol.tokenizer.decode(list(method.pool.load(entry).token_ids)) == entry["payload"]

    # no sample has an answer: the greedy answer is logged instead
    scripted.texts = ["I do not know"] * 4
    out = method.answer("What is 4 plus 4?", 1)
    method.learn("What is 4 plus 4?", "q1", out)
    assert out.extra["log_vote"]["rollout"] is None and out.extra["log_vote"]["majority"] is None
    second = next(e for e in method.pool.entries if e["question_id"] == "q1")
    assert "I do not know" not in second["payload"] and out.response.strip() in second["payload"]
