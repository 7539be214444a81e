"""The CUDA paths: placement, generation, keys and memory training on a GPU give what the CPU gives.

Skipped where no CUDA device exists (every CI machine): run them on a GPU with
``pytest -m cuda tests/test_cuda.py``. ``benchmarks/gpu_check.py`` times the paper's learning
settings there (docs/results/gpu-h200.md).

The model is a randomly initialised 2-layer Qwen2 (grouped-query attention) with the default
model's real tokenizer, saved to a folder and loaded by :func:`load_model`, so the loader's own
device and dtype decisions are exercised. Its tokenizer comes from ``ELM_TEST_TOKENIZER_DIR``
(a folder with the default model's tokenizer files) or else from the prepared default model.
Comparisons with the CPU run in float32, where both devices compute the same numbers up to
rounding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from _fakes import ScriptedRollouts, tiny_qwen2_config

from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.backends.hf import HFBackend
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig, ModelConfig
from elm_memory.hardware import resolve_placement
from elm_memory.memory import LatentMemory
from elm_memory.memory.keys import InputKeyBuilder, KVKeyBuilder
from elm_memory.models.loading import LoadedModel, load_model
from elm_memory.training.learn import learn_memory

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"),
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
ROLLOUTS = ["so \\boxed{7}", "\\boxed{7} apples", "maybe \\boxed{8}", "\\boxed{7}"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _tokenizer_dir() -> Path:
    given = os.environ.get("ELM_TEST_TOKENIZER_DIR")
    if given:
        return Path(given)
    from elm_memory.models.prepare import prepare_model

    return Path(prepare_model("packaged:qwen2.5-coder-0.5b", verbose=False))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 in float32 with the default model's tokenizer, as a model folder."""
    import shutil

    from transformers import AutoTokenizer, Qwen2ForCausalLM

    source = _tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(source))
    torch.manual_seed(0)
    cfg = tiny_qwen2_config(
        len(tok),
        1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("random-qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def _load(folder: Path, device: str, dtype: Literal["auto", "float32"] = "float32") -> LoadedModel:
    return load_model(ModelConfig(name_or_path=str(folder), device=device, dtype=dtype))


@pytest.fixture(scope="module")
def on_cuda(model_dir) -> LoadedModel:
    return _load(model_dir, "auto")  # auto must pick the GPU


@pytest.fixture(scope="module")
def on_cpu(model_dir) -> LoadedModel:
    return _load(model_dir, "cpu")


def _prompt(loaded: LoadedModel, k: int = 0) -> tuple[tuple[int, ...], int]:
    built = PromptBuilder(loaded.tokenizer, ELMConfig().prompt, loaded.info.max_context).answer_prompt(
        QUESTION, memory_tokens=k
    )
    return tuple(built.token_ids), built.memory_at


def _soft_prompt(loaded: LoadedModel, k: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(k, loaded.info.hidden_size, generator=g) * 0.05  # on the CPU, as a stored memory is


def test_auto_places_the_model_on_the_gpu_in_bf16(model_dir, on_cuda):
    placement = resolve_placement(ModelConfig(name_or_path=str(model_dir), device="auto", dtype="auto"))
    assert placement.device.startswith("cuda")
    assert placement.dtype == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
    assert placement.attn_implementation == "sdpa"
    auto = _load(model_dir, "auto", "auto")
    first = next(auto.model.parameters())
    assert first.is_cuda and first.dtype == getattr(torch, placement.dtype)
    assert auto.info.device.startswith("cuda") and on_cuda.info.device.startswith("cuda")
    assert all(p.is_cuda and not p.requires_grad for p in on_cuda.model.parameters())


def test_a_cpu_soft_prompt_scores_on_the_gpu_as_on_the_cpu(on_cuda, on_cpu):
    """A memory loaded from the store lives on the CPU; the GPU backend must move it, not fail."""
    ids, at = _prompt(on_cpu, k=5)
    soft = _soft_prompt(on_cpu)
    cpu, gpu = HFBackend(on_cpu), HFBackend(on_cuda)
    prompt = PromptInput(ids, soft_prompt=soft, soft_prompt_at=at)
    [[greedy]] = cpu.generate([prompt], SamplingParams(max_new_tokens=12))
    assert len(greedy.token_ids) > 0
    [on_gpu] = gpu.token_logprobs(prompt, [greedy.token_ids])
    [reference] = cpu.token_logprobs(prompt, [greedy.token_ids])
    assert torch.allclose(torch.tensor(on_gpu), torch.tensor(reference), atol=1e-4)
    [bare] = gpu.token_logprobs(PromptInput(ids), [greedy.token_ids])
    assert not torch.allclose(torch.tensor(bare), torch.tensor(on_gpu), atol=1e-3)  # the soft prompt was used


def test_seeded_sampling_repeats_on_the_gpu_and_lookup_keeps_greedy_tokens(on_cuda):
    ids, _ = _prompt(on_cuda)
    plain = HFBackend(on_cuda)
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, n=4, seed=11)
    first = [g.token_ids for g in plain.generate([PromptInput(ids, seed=11)], sampled)[0]]
    again = [g.token_ids for g in plain.generate([PromptInput(ids, seed=11)], sampled)[0]]
    assert first == again and len({tuple(t) for t in first}) > 1
    greedy = SamplingParams(max_new_tokens=40)
    [[base]] = plain.generate([PromptInput(ids)], greedy)
    [[drafted]] = HFBackend(on_cuda, lookup_draft_tokens=3).generate([PromptInput(ids)], greedy)
    assert drafted.token_ids == base.token_ids


def test_retrieval_keys_on_the_gpu_equal_the_cpus(on_cuda, on_cpu):
    q_ids = on_cpu.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    soft = _soft_prompt(on_cpu)
    for builder in (InputKeyBuilder(), KVKeyBuilder()):
        gpu_q, cpu_q = builder.query_key(on_cuda, q_ids), builder.query_key(on_cpu, q_ids)
        gpu_m, cpu_m = builder.memory_key(on_cuda, soft, q_ids), builder.memory_key(on_cpu, soft, q_ids)
        for gpu, cpu in ((gpu_q, cpu_q), (gpu_m, cpu_m)):
            assert gpu.device.type == "cpu"  # keys go to the store as CPU tensors
            assert torch.allclose(gpu.float(), cpu.float(), atol=1e-4), builder.kind


@pytest.mark.parametrize("kind", ["soft_prompt", "lora", "prefix"])
def test_a_memory_trained_on_the_gpu_equals_the_cpus_and_reloads(on_cuda, on_cpu, kind, tmp_path):
    """Same scripted rollouts (known rewards), same seed: the GPU trains the memory the CPU trains;
    it comes back as CPU tensors, is saved with safetensors and conditions the GPU model again."""
    cfg = ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "training": {"steps": 3, "num_generations": 4, "learning_rate": 1e-2},
            "memory": {"kind": kind, "num_tokens": 6},
        },
    )

    def train(loaded: LoadedModel) -> LatentMemory:
        prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
        backend = ScriptedRollouts(HFBackend(loaded), ROLLOUTS)
        return learn_memory(QUESTION, config=cfg, loaded=loaded, backend=backend, prompts=prompts)

    gpu, cpu = train(on_cuda), train(on_cpu)
    gpu_tensors, cpu_tensors = gpu.params, cpu.params
    assert gpu_tensors.keys() == cpu_tensors.keys() and gpu_tensors
    lr, steps = cfg.training.learning_rate, cfg.training.steps
    for name, tensor in gpu_tensors.items():
        assert tensor.device.type == "cpu" and torch.isfinite(tensor).all(), name
        apart = ~torch.isclose(tensor, cpu_tensors[name], atol=1e-4, rtol=1e-3)
        if kind != "lora":
            assert not apart.any(), name
            continue
        # AdamW moves every element by about lr per step whatever its gradient's size, so an element
        # whose gradient is rounding noise moves either way on the two devices. LoRA has such
        # elements (B starts at zero, and A's first gradient comes from B's first step): allow a
        # few, parted by no more than AdamW can move an element in S steps.
        share = apart.float().mean().item()
        assert share <= 0.01, f"{name}: {share:.4f} of elements apart"
        assert (tensor - cpu_tensors[name]).abs().max().item() <= 4 * lr * steps, name
    assert gpu.meta.stats.answers == cpu.meta.stats.answers
    assert not all(gpu.meta.stats.skipped_backward)  # the scripted rewards differ: it really trained

    reloaded = LatentMemory.load(gpu.save(tmp_path / "memory.safetensors"))
    reloaded.check_compatible(on_cuda.info)
    k = cfg.memory.num_tokens if kind == "soft_prompt" else 0
    ids, at = _prompt(on_cuda, k=k)
    if kind == "soft_prompt":
        prompt = PromptInput(ids, soft_prompt=reloaded.soft_prompt, soft_prompt_at=at)
    else:
        prompt = PromptInput(ids, memory=reloaded.adapter())
    [[out]] = HFBackend(on_cuda).generate([prompt], SamplingParams(max_new_tokens=8))
    assert len(out.token_ids) > 0


def test_real_rollouts_train_a_memory_on_the_gpu(on_cuda):
    """The real sampling path (per-prompt seeds, G rollouts, backward through the frozen model) on CUDA."""
    cfg = ELMConfig.load(
        preset="cpu-tiny", overrides={"training": {"steps": 2, "num_generations": 4, "max_completion_length": 16}}
    )
    prompts = PromptBuilder(on_cuda.tokenizer, cfg.prompt, on_cuda.info.max_context)
    memory = learn_memory(QUESTION, config=cfg, loaded=on_cuda, backend=HFBackend(on_cuda), prompts=prompts)
    assert memory.soft_prompt.device.type == "cpu" and torch.isfinite(memory.soft_prompt).all()
    assert memory.meta.stats.completion_tokens > 0


@pytest.fixture(scope="module")
def on_cuda_fp32(model_dir) -> LoadedModel:
    return _load(model_dir, "cuda")


def _tokens(out: list[list[Any]]) -> list[list[list[int]]]:
    return [[list(g.token_ids) for g in gens] for gens in out]


def test_captured_steps_give_the_plain_loops_tokens_through_the_backend(on_cuda_fp32):
    """CUDA graphs (backend.decode_graphs=on) against the plain loop in float32: ELM's greedy answer pair
    (zero-shot + soft prompt, stop at the boxed answer) and 8 seeded rollouts, each twice (the second
    call replays what the first captured)."""
    loaded = on_cuda_fp32
    ids, at = _prompt(loaded, k=5)
    prompts = [PromptInput(_prompt(loaded)[0]), PromptInput(ids, soft_prompt=_soft_prompt(loaded), soft_prompt_at=at)]
    plain, graphs = HFBackend(loaded, decode_graphs="off"), HFBackend(loaded, decode_graphs="on")
    for params in (
        SamplingParams(max_new_tokens=40, stop_at_answer=True),
        SamplingParams(max_new_tokens=40, temperature=0.8, n=8, seed=5, stop_at_answer=True),
    ):
        for _ in range(2):
            assert _tokens(graphs.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert graphs._captured is not None and graphs._captured.compiled and graphs._captured.buckets_seen


def test_captured_steps_keep_seeded_draws_while_rows_finish_in_place_and_with_a_prefix(on_cuda_fp32):
    """Rows stop at different steps (finished rows stay masked in their bucket, live ones move to a
    smaller one) and a prefix memory starts the cache: the same tokens as the plain loop."""
    from elm_memory.backends.captured import CapturedSteps
    from elm_memory.backends.decode import DecodeOptions, sample
    from elm_memory.memory.prefix import question_prefix

    loaded = on_cuda_fp32
    ids, _ = _prompt(loaded)
    input_ids = torch.tensor([ids], device="cuda")
    mask = torch.ones_like(input_ids)
    lengths = [2, 30, 3, 5, 2, 9, 4, 30]
    steps = CapturedSteps(loaded.model, compile=True, max_rows=8, max_cache_len=1024)

    def run(captured: CapturedSteps | None, memory: Any = None) -> list[tuple[list[int], str]]:
        return sample(
            loaded.model,
            mask,
            DecodeOptions(30, temperature=0.8, n=8),
            input_ids=input_ids,
            generators=[torch.Generator(device="cuda").manual_seed(7)],
            should_stop=lambda row, tokens, tok: len(tokens) >= lengths[row],
            captured=captured,
            memory=memory,
        )

    assert run(steps) == run(None)
    assert [b for b, _ in steps.buckets_seen] == [8, 2]
    prefix = question_prefix(loaded, ids, 4)
    assert run(steps, prefix) == run(None, prefix)
