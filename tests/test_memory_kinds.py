"""Memory parameterisations (``memory.kind``: soft_prompt | lora | prefix): training by the same GRPO loop,
application without touching the shared model, storage, retrieval, PEFT export, and the typed refusals.

Real weights: SmolLM2-135M in float32 (``smol``). A random tiny Llama checks shapes against a second,
different model."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch
from _fakes import ScriptedRollouts, weights_checksum

from elm_memory.backends.base import PromptInput, SamplingParams
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.backends.teacher_forcing import completion_logits
from elm_memory.config import ELMConfig
from elm_memory.errors import (
    AdapterError,
    ConfigError,
    IncompatibleMemoryError,
    MemoryFormatError,
    MemoryKindError,
)
from elm_memory.memory import LatentMemory, MemoryMeta, TrainingStats
from elm_memory.memory.lora import TARGET_MODULES, LoraAdapter
from elm_memory.memory.prefix import question_prefix
from elm_memory.models.loading import LoadedModel, ModelInfo
from elm_memory.training.learn import learn_memories, learn_memory

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
OTHER = "A train travels 60 km in 1.5 hours. What is its speed in km/h?"
PROMPT = "Question: how many apples?\nAnswer:"
ROLLOUTS = ["so \\boxed{7}", "\\boxed{7} apples", "maybe \\boxed{8}", "\\boxed{7}"]


def _config(kind: str, **memory) -> ELMConfig:
    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={"training": {"steps": 3, "num_generations": 4}, "memory": {"kind": kind, "num_tokens": 6, **memory}},
    )


def _learn(smol, kind: str, question: str = QUESTION, **memory) -> tuple[LatentMemory, ScriptedRollouts]:
    cfg = _config(kind, **memory)
    prompts = PromptBuilder(smol.tokenizer, cfg.prompt, smol.info.max_context)
    scripted = ScriptedRollouts(_Real(smol), ROLLOUTS)
    memory_ = learn_memory(question, config=cfg, loaded=smol, backend=scripted, prompts=prompts)
    return memory_, scripted


_LEARNED: dict[str, LatentMemory] = {}


def _learned(smol, kind: str) -> LatentMemory:
    """A memory of ``kind`` learned with ``_learn``'s defaults, once per module: the tests that only read such a
    memory share it, each through its own copy, so none sees another's changes (each learning costs seconds)."""
    if kind not in _LEARNED:
        _LEARNED[kind] = _learn(smol, kind)[0]
    return copy.deepcopy(_LEARNED[kind])


class _Real:
    def __init__(self, loaded):
        self.tokenizer, self.info = loaded.tokenizer, loaded.info


def _ids(smol, text: str) -> list[int]:
    return smol.tokenizer(text, add_special_tokens=False)["input_ids"]


def _logits(smol, memory=None, *, share: bool = False) -> torch.Tensor:
    prompt = PromptInput(tuple(_ids(smol, PROMPT)), memory=memory)
    with torch.no_grad():
        return completion_logits(smol.model, [prompt], [_ids(smol, " 7 apples")], share_prompt_kv=share)[0]


# -- a random tiny model: shapes only ----------------------------------------------------


@pytest.fixture(scope="module")
def random_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    info = ModelInfo.from_config(
        cfg, name="random-tiny", path="/nowhere", vocab_size=64, dtype="float32", device="cpu", fingerprint="f" * 16
    )
    return LoadedModel(model=model, tokenizer=None, info=info, load_seconds=0.0)


def test_lora_and_prefix_shapes_follow_the_model(random_tiny):
    lora = LoraAdapter.initial(random_tiny.model, rank=4, alpha=8, seed=0)
    assert len(lora.weights) == 2 * len(TARGET_MODULES)  # every projection of both layers
    a, b = lora.weights["model.layers.1.mlp.down_proj"]
    assert a.shape == (4, 40) and b.shape == (16, 4) and not b.any()  # B = 0: the base model
    assert lora.max_layer() == 1
    prefix = question_prefix(random_tiny, [3, 5, 7], 5)  # shorter than k: tiled
    assert len(prefix.keys) == 2 and prefix.keys[0].shape == (2, 5, 4) and prefix.values[1].shape == (2, 5, 4)
    prefix.check_info(random_tiny.info)


def test_adapters_refuse_another_models_shapes(random_tiny, smol):
    lora = LoraAdapter.initial(random_tiny.model, rank=4, alpha=8)
    with pytest.raises(IncompatibleMemoryError), lora.apply(smol.model, 1):
        pass
    prefix = question_prefix(random_tiny, [3, 5, 7], 2)
    with pytest.raises(IncompatibleMemoryError):
        prefix.check_info(smol.info)
    with pytest.raises(IncompatibleMemoryError), prefix.apply(smol.model, 1):
        pass


# -- LoRA on real weights ----------------------------------------------------------------


@pytest.mark.model
def test_untrained_lora_is_the_base_model_and_hooks_leave_no_trace(smol):
    def hooks() -> dict[str, list[int]]:  # the shared model may carry other code's hooks: compare, not count
        return {n: sorted(m._forward_hooks) for n, m in smol.model.named_modules() if m._forward_hooks}

    before = hooks()
    base = _logits(smol)
    lora = LoraAdapter.initial(smol.model, rank=16, alpha=32, seed=1)
    assert torch.equal(_logits(smol, lora), base)  # B = 0
    lora.weights["model.layers.0.self_attn.q_proj"][1].normal_(0, 0.05)  # a non-zero delta...
    assert not torch.allclose(_logits(smol, lora), base, atol=1e-4)
    assert torch.equal(_logits(smol), base)  # ...active only while applied: the hooks are gone afterwards
    assert hooks() == before


@pytest.mark.model
def test_lora_hooks_condition_only_the_thread_that_applied_them(smol):
    """A background learner may train a lora memory while another thread answers zero-shot on the same model."""
    import threading

    base = _logits(smol)
    lora = LoraAdapter.initial(smol.model, rank=16, alpha=32, seed=1)
    for _, b in lora.weights.values():
        b.normal_(0, 0.05)
    seen: list[torch.Tensor] = []
    with lora.apply(smol.model, 1):
        worker = threading.Thread(target=lambda: seen.append(_logits(smol)))
        worker.start()
        worker.join()
        with torch.no_grad():
            mine = completion_logits(smol.model, [PromptInput(tuple(_ids(smol, PROMPT)))], [_ids(smol, " 7 apples")])[0]
    assert torch.equal(seen[0], base)
    assert not torch.allclose(mine, base, atol=1e-3)


def test_a_lora_digest_follows_its_tensors_and_a_detached_copy_computes_it_once(monkeypatch):
    import elm_memory.memory.lora as lora_module

    weights = {"m.q_proj": (torch.ones(2, 4), torch.zeros(3, 2))}
    live = LoraAdapter(weights, alpha=4.0)
    copy = live.detached()
    first = live.digest()
    assert copy.digest() == first
    weights["m.q_proj"][1][0, 0] = 1.0  # trained in place: the live adapter's digest moves, the copy's tensors did not
    assert live.digest() != first and copy.digest() == first
    calls = []
    monkeypatch.setattr(lora_module, "digest_tensors", lambda t: calls.append(1) or "x")
    assert copy.digest() == first and calls == []  # cached
    live.digest()
    assert calls == [1]  # never cached for tensors that may change


@pytest.mark.model
def test_grpo_trains_a_lora_memory_and_never_the_model(smol):
    before = weights_checksum(smol.model)
    memory, scripted = _learn(smol, "lora", learning_rate=1e-3)
    assert weights_checksum(smol.model) == before  # bit-identical base weights
    assert all(not p.requires_grad for p in smol.model.parameters())
    assert memory.kind == "lora" and memory.meta.num_tokens == 0 and memory.meta.adapter == {"alpha": 32.0}
    s = memory.meta.stats
    assert s.skipped_backward == [False, False, False] and s.kl[0] == 0.0 and s.kl[-1] > 0.0
    # rollouts were sampled under the memory as it was at each step (a snapshot, no soft prompt)
    assert all(c.memory is not None and c.soft_prompt is None for c in scripted.calls)
    assert not any(t.any() for n, t in scripted.calls[0].memory.tensors().items() if n.endswith(".B"))
    adapter = memory.adapter()
    assert any(t.any() for n, t in adapter.tensors().items() if n.endswith(".B"))  # B learned something
    assert memory.num_parameters == sum(
        16 * (lin.in_features + lin.out_features)
        for lin in (m for m in smol.model.modules() if isinstance(m, torch.nn.Linear))
        if lin is not smol.model.lm_head
    )
    assert (_logits(smol, adapter) - _logits(smol)).abs().max() > 1e-3


@pytest.mark.model
def test_a_lora_memory_is_never_a_soft_prompt(smol):
    memory = _learned(smol, "lora")
    with pytest.raises(MemoryKindError):
        memory.soft_prompt  # noqa: B018
    prompt = PromptBuilder(smol.tokenizer, _config("lora").prompt, smol.info.max_context).answer_prompt(
        QUESTION, memory_tokens=6
    )
    conditioned = prompt.for_memory(memory)
    assert conditioned.soft_prompt is None and conditioned.memory is not None
    assert conditioned.token_ids == prompt.zero_shot().token_ids
    with pytest.raises(ValueError):
        PromptInput((1, 2), soft_prompt=torch.zeros(1, 4), memory=memory.adapter())
    from elm_memory.store.merge import average_memory

    with pytest.raises(MemoryKindError):
        average_memory([memory, memory])


@pytest.mark.model
def test_trl_engine_refuses_lora(smol):
    from elm_memory.training.engines import trl_trainer

    cfg = _config("lora").model_copy(deep=True)
    cfg.training.engine = "trl"
    with pytest.raises(ConfigError, match="soft-prompt memories only"):
        trl_trainer(cfg, smol, None)  # type: ignore[arg-type]


# -- prefix on real weights --------------------------------------------------------------


@pytest.mark.model
def test_prefix_of_the_whole_question_is_the_question_as_context(smol):
    """Init: the question's last k keys/values, rotated as if right before the prompt. With k = the
    question's length that is exactly the question prepended as text (up to float rounding)."""
    q = _ids(smol, QUESTION)
    prefix = question_prefix(smol, q, len(q))
    comp = [_ids(smol, " 7 apples")]
    with torch.no_grad():
        as_text = completion_logits(smol.model, [PromptInput(tuple(q + _ids(smol, PROMPT)))], comp)[0]
    for share in (False, True):
        assert torch.allclose(_logits(smol, prefix, share=share), as_text, atol=1e-3)
    assert (_logits(smol, prefix) - _logits(smol)).abs().max() > 1.0  # and it changes what the model predicts


@pytest.mark.model
def test_hf_backend_generates_under_a_prefix_and_a_lora_memory(smol, tiny_backend):
    q = _ids(smol, QUESTION)
    prefix = question_prefix(smol, q, len(q))
    lora = LoraAdapter.initial(smol.model, rank=16, alpha=32)
    prompt = tuple(_ids(smol, PROMPT))
    params = SamplingParams(max_new_tokens=6)
    as_text, under_prefix, plain, under_lora = tiny_backend.generate(
        [
            PromptInput(tuple(q) + prompt),
            PromptInput(prompt, memory=prefix),
            PromptInput(prompt),
            PromptInput(prompt, memory=lora),
        ],
        params,
    )
    assert under_prefix[0].token_ids == as_text[0].token_ids  # greedy: the question as context
    assert under_lora[0].token_ids == plain[0].token_ids  # zero-B lora: the base model


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_grpo_trains_a_prefix_memory(smol):
    before = weights_checksum(smol.model)
    memory, scripted = _learn(smol, "prefix")
    assert weights_checksum(smol.model) == before
    assert memory.kind == "prefix" and memory.meta.num_tokens == 6
    adapter = memory.adapter()
    init = question_prefix(smol, _ids(smol, QUESTION), 6)
    assert adapter.keys[0].shape == (smol.info.num_key_value_heads, 6, smol.info.head_dim)
    assert all(c.memory is not None for c in scripted.calls)
    assert torch.equal(scripted.calls[0].memory.keys[3], init.keys[3])  # step 1 rolls out the initial prefix
    moved = max((a - b).abs().max().item() for a, b in zip(adapter.parameters(), init.parameters(), strict=True))
    assert moved > 1e-4  # lr 1e-3 (the paper's for prefix tuning) over 3 steps
    assert memory.meta.config["memory"]["kind"] == "prefix"
    assert not torch.allclose(_logits(smol, adapter), _logits(smol, init), atol=1e-5)


# -- storage -----------------------------------------------------------------------------


def _old_soft_prompt_bytes() -> bytes:
    meta = MemoryMeta(
        id="ab" * 16,
        namespace="default",
        question="What is 2+3?",
        question_hash="h",
        model_name="m",
        hidden_size=4,
        model_fingerprint="fp",
        created_at=1.5,
        num_tokens=3,
        config={"memory": {"num_tokens": 3, "init": "question"}},
        stats=TrainingStats(steps=1, mean_reward=[0.5]),
    )
    sp = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    return LatentMemory(soft_prompt=sp, meta=meta, keys={"input": torch.ones(4)}).to_bytes()


def test_soft_prompt_files_are_byte_identical_to_format_1():
    """sha256 of this memory as the library wrote it before memory kinds existed (commit ec8e7bc)."""
    data = _old_soft_prompt_bytes()
    assert hashlib.sha256(data).hexdigest() == "9beb9c77ec1318141a2661e522c360ad316eb3a954af0d13f7d4effb2066ebd8"
    loaded = LatentMemory.from_bytes(data)
    assert loaded.kind == "soft_prompt" and loaded.to_bytes() == data


@pytest.mark.model
@pytest.mark.parametrize("kind", ["lora", pytest.param("prefix", marks=(pytest.mark.slow, pytest.mark.extended))])
def test_adapter_memories_round_trip_and_keep_their_kind(smol, tmp_path, kind):
    memory = _learned(smol, kind)
    path = memory.save(tmp_path / "m.safetensors")
    back = LatentMemory.load(path)
    assert back.kind == kind and back.to_bytes() == memory.to_bytes()
    assert set(back.params) == set(memory.params)
    assert all(torch.equal(back.params[n], t) for n, t in memory.params.items())
    prefix = "lora." if kind == "lora" else "prefix."
    assert all(n.startswith(prefix) for n in back.params)
    assert torch.equal(_logits(smol, back.adapter()), _logits(smol, memory.adapter()))
    back.check_compatible(smol.info)


def _rewrite(memory: LatentMemory, *, tensors=None, meta=None) -> bytes:
    """The memory's file with tensors replaced/added/removed (None value: removed) or metadata fields changed."""
    from safetensors.torch import save

    out = {**memory.params, **{f"key.{k}": v for k, v in memory.keys.items()}}
    for name, t in (tensors or {}).items():
        if t is None:
            out.pop(name)
        else:
            out[name] = t
    raw = json.loads(memory.meta.to_json())
    raw.update(meta or {})
    return save(out, metadata={"elm_memory": json.dumps(raw)})


@pytest.mark.model
def test_corrupt_or_mismatched_adapter_files_are_refused(smol):
    import dataclasses

    lora = _learned(smol, "lora")
    name = next(n for n in lora.params if n.endswith("q_proj.B"))
    bad_b = lora.params[name].clone()
    bad_b[0, 0] = float("nan")
    with pytest.raises(MemoryFormatError, match="NaN"):
        LatentMemory.from_bytes(_rewrite(lora, tensors={name: bad_b}))
    with pytest.raises(MemoryFormatError, match="lacks its A or B"):
        LatentMemory.from_bytes(_rewrite(lora, tensors={name: None}))
    with pytest.raises(MemoryFormatError, match="unexpected tensor"):
        LatentMemory.from_bytes(_rewrite(lora, tensors={"soft_prompt": torch.zeros(2, 576)}))
    with pytest.raises(MemoryFormatError, match="unknown memory kind"):
        LatentMemory.from_bytes(_rewrite(lora, meta={"kind": "dora"}))
    with pytest.raises(MemoryFormatError, match="width"):  # an A of another hidden size
        LatentMemory.from_bytes(_rewrite(lora, tensors={name.replace(".B", ".A"): torch.zeros(16, 100)}))
    with pytest.raises(MemoryFormatError):  # the kind removed: read as a soft prompt, which it is not
        LatentMemory.from_bytes(_rewrite(lora, meta={"kind": "soft_prompt", "adapter": {}}))
    other = dataclasses.replace(smol.info, fingerprint="0" * 16)
    with pytest.raises(IncompatibleMemoryError):
        lora.check_compatible(other)

    prefix = _learned(smol, "prefix")
    with pytest.raises(MemoryFormatError, match="prefix.<l>.key"):
        LatentMemory.from_bytes(_rewrite(prefix, tensors={"prefix.29.value": None}))
    with pytest.raises(MemoryFormatError, match="tokens"):
        LatentMemory.from_bytes(_rewrite(prefix, meta={"num_tokens": 5}))
    with pytest.raises(IncompatibleMemoryError, match="layers"):
        prefix.check_compatible(dataclasses.replace(smol.info, num_layers=12))


# -- retrieval ---------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("key", ["input", pytest.param("kv", marks=(pytest.mark.slow, pytest.mark.extended))])
def test_each_kind_grows_the_pool_and_retrieval_keeps_to_its_kind(smol, tmp_path, key):
    from elm_memory.memory.keys import key_builders
    from elm_memory.retrieval.retriever import Retriever
    from elm_memory.store.chroma import ChromaMemoryStore

    store = ChromaMemoryStore(tmp_path / "s", model=smol.info)
    builder = key_builders.get(key)()
    made = {}
    for kind in ("soft_prompt", "lora", "prefix"):
        memory = _learned(smol, kind)
        Retriever(store, builder, smol, memory_kind=kind).index_memory(memory)
        made[kind] = memory
        assert store.count("default", kind=key) == len(made)  # the pool grows
    for kind, memory in made.items():
        hits, decision = Retriever(store, builder, smol, memory_kind=kind).retrieve_with_gates(QUESTION, "default")
        assert [h.memory.id for h in hits] == [memory.id] and hits[0].memory.kind == kind
        # the same question ranks all three equally (input) or close (kv): the others were passed over
        assert decision.decision == "used"
    # a pool read as soft prompts never hands out a lora/prefix memory, even the best match
    lora_only = tmp_path / "lora-only"
    store2 = ChromaMemoryStore(lora_only, model=smol.info)
    Retriever(store2, builder, smol, memory_kind="lora").index_memory(made["lora"])
    hits, decision = Retriever(store2, builder, smol, memory_kind="soft_prompt").retrieve_with_gates(
        QUESTION, "default"
    )
    assert hits == [] and decision.decision == "other_kind"
    with pytest.raises(MemoryKindError):
        Retriever(store2, builder, smol, memory_kind="soft_prompt").index_memory(made["prefix"])


@pytest.mark.model
def test_soft_prompt_mean_keys_refuse_adapter_memories(smol, tmp_path):
    from elm_memory.memory.keys import SoftPromptMeanKeyBuilder
    from elm_memory.retrieval.retriever import Retriever
    from elm_memory.store.chroma import ChromaMemoryStore

    memory = _learned(smol, "lora")
    retriever = Retriever(ChromaMemoryStore(tmp_path / "s", model=smol.info), SoftPromptMeanKeyBuilder(), smol)
    with pytest.raises(ConfigError, match="soft_prompt_mean"):
        retriever.index_memory(memory)


# -- PEFT export -------------------------------------------------------------------------


@pytest.mark.model
def test_lora_export_loads_in_peft_with_our_logits(smol, tmp_path):
    """The exported folder through the real ``PeftModel`` (on its own copy of the model: PEFT replaces the
    target modules) gives the logits of our own hook-based application."""
    from peft import PeftModel

    from elm_memory.config import ModelConfig
    from elm_memory.memory.peft import export_adapter
    from elm_memory.models.loading import load_model

    memory, _ = _learn(smol, "lora", learning_rate=1e-3)
    folder = export_adapter(memory, tmp_path / "adapter", position="prefix", base_model=smol.info.path)
    ours = _logits(smol, memory.adapter())
    copy = load_model(ModelConfig(name_or_path="packaged:smollm2-135m", dtype="float32", device="cpu"))
    peft_model = PeftModel.from_pretrained(copy.model, str(folder)).eval()
    prompt = torch.tensor([_ids(smol, PROMPT) + _ids(smol, " 7 apples")])
    with torch.no_grad():
        theirs = peft_model(input_ids=prompt).logits[0]
    n = len(_ids(smol, " 7 apples"))
    assert torch.allclose(theirs[-n - 1 : -1], ours[0], atol=1e-4)
    assert (ours[0] - _logits(smol)[0]).abs().max() > 1e-3  # and the adapter is not a no-op


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_prefix_memories_are_not_exported_or_served_by_vllm(smol, tmp_path):
    from elm_memory.backends.vllm.lora import check_kind
    from elm_memory.memory.peft import export_adapter

    memory = _learned(smol, "prefix")
    with pytest.raises(AdapterError, match="prefix"):
        export_adapter(memory, tmp_path / "a", position="prefix", base_model="x")
    with pytest.raises(ConfigError, match="prefix"):
        check_kind("prefix", "vllm", lora=True)
    with pytest.raises(ConfigError, match="lora"):
        check_kind("lora", "vllm-server", lora=False)
    check_kind("lora", "vllm", lora=True)


def test_vllm_backend_refuses_a_prefix_config_before_starting():
    from elm_memory.backends.vllm.engine import VLLMBackend
    from elm_memory.backends.vllm.server_backend import VLLMServerBackend

    cfg = _config("prefix")
    with pytest.raises(ConfigError, match="prefix"):
        VLLMBackend.from_config(cfg)
    with pytest.raises(ConfigError, match="prefix"):
        VLLMServerBackend.from_config(cfg)


def test_memory_kind_config():
    cfg = _config("prefix")
    assert cfg.memory.effective_learning_rate(cfg.training.learning_rate) == 1e-3  # paper: prefix tuning
    lora = _config("lora")
    assert lora.memory.effective_learning_rate(lora.training.learning_rate) == 1e-4 and lora.memory.lora_rank == 16
    assert ELMConfig.load(preset="cpu-tiny").memory.kind == "soft_prompt"
    with pytest.raises(ConfigError):
        _config("dora")
    # parts that cannot handle a lora/prefix memory are refused when the config loads, before any model work
    for kind, section, value in [
        ("lora", "retrieval", {"key": "soft_prompt_mean"}),
        ("prefix", "training", {"engine": "trl"}),
        ("prefix", "backend", {"name": "vllm"}),
        ("lora", "backend", {"name": "vllm-server"}),
    ]:
        with pytest.raises(ConfigError, match=kind):
            ELMConfig.load(preset="cpu-tiny", overrides={"memory": {"kind": kind}, section: value})
    ELMConfig.load(preset="cpu-tiny", overrides={"memory": {"kind": "lora"}, "backend": {"name": "vllm"}})


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.extended
def test_learn_memories_batches_adapter_memories(smol):
    """Several lora memories in one train_many call: each is trained on its own rows (no micro-batch mixes two)."""
    cfg = _config("lora", learning_rate=1e-3)
    prompts = PromptBuilder(smol.tokenizer, cfg.prompt, smol.info.max_context)
    both = learn_memories(
        [QUESTION, OTHER], config=cfg, loaded=smol, backend=ScriptedRollouts(_Real(smol), ROLLOUTS), prompts=prompts
    )
    alone = learn_memory(
        OTHER, config=cfg, loaded=smol, backend=ScriptedRollouts(_Real(smol), ROLLOUTS), prompts=prompts
    )
    a, b, c = both[1].adapter(), alone.adapter(), both[0].adapter()

    def gap(x, y) -> float:  # L2 distance over all the memory's tensors
        return sum(((s - t) ** 2).sum().item() for s, t in zip(x.parameters(), y.parameters(), strict=True)) ** 0.5

    # equal up to float noise: AdamW turns near-zero gradients of A (zero at B = 0) into +-lr steps whose sign
    # float rounding decides, so two runs alone differ in a few hundredths of a percent of the entries; the
    # other question's memory differs in all of them
    assert gap(a, b) < 0.1 * gap(c, b)


@pytest.mark.model
def test_offline_greedy_answers_apply_adapter_memories(smol, tiny_backend):
    """The offline protocol answers with any memory kind (a zero-B lora memory answers as zero-shot does)."""
    from elm_memory.data.datasets import Problem
    from elm_memory.eval.offline import greedy_answers

    cfg = _config("lora")
    cfg.generation.max_new_tokens = 8
    prompts = PromptBuilder(smol.tokenizer, cfg.prompt, smol.info.max_context)
    untrained = LatentMemory.create(
        question=QUESTION,
        namespace="default",
        model=smol.info,
        adapter=LoraAdapter.initial(smol.model, rank=4, alpha=8),
    )
    problems = [Problem("p1", QUESTION, "7")]
    assert greedy_answers(cfg, prompts, tiny_backend, problems, untrained) == greedy_answers(
        cfg, prompts, tiny_backend, problems
    )
    prefix = LatentMemory.create(
        question=OTHER, namespace="default", model=smol.info, adapter=question_prefix(smol, _ids(smol, OTHER), 6)
    )
    assert greedy_answers(cfg, prompts, tiny_backend, problems, prefix)[0][1]  # it runs and answers


def test_a_lora_memory_of_the_packaged_1_5b_saves_and_loads_back(tmp_path):
    """Rank 16 on all seven projections of Qwen2.5-1.5B's 28 layers is 74 MB: over the old 64 MiB cap, which
    refused the stream memory's first version on the packaged 1.5B."""
    hidden, kv, inner, rank = 1536, 256, 8960, 16
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}  # fmt: skip
    weights = {}
    for layer in range(28):
        for short, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if short.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            weights[f"model.layers.{layer}.{part}.{short}"] = (torch.zeros(rank, fan_in), torch.zeros(fan_out, rank))
    info = ModelInfo(name="qwen2.5-coder-1.5b", path="/nowhere", model_type="qwen2", hidden_size=hidden,
                     num_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                     max_context=32768, dtype="float32", device="cpu", fingerprint="f" * 16)  # fmt: skip
    memory = LatentMemory.create(question="q", namespace="default", model=info, adapter=LoraAdapter(weights, 32.0))
    path = memory.save(tmp_path / "v.safetensors")
    assert path.stat().st_size > 64 * 1024 * 1024
    back = LatentMemory.load(path)
    assert back.kind == "lora" and back.num_parameters == memory.num_parameters == 18_464_768
