"""Shared test setup: fake model facts and memories for tests that need no real model, and a
one-thread guard for tests on real (small) matrices."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from elm_memory.backends.base import Generation, PromptInput, SamplingParams
from elm_memory.memory import LatentMemory, TrainingStats
from elm_memory.models.loading import ModelInfo


def tiny_qwen2_config(vocab_size: int, max_position_embeddings: int, **extra: Any) -> Any:
    """A 2-layer Qwen2 with grouped-query attention (4 heads, 2 KV heads, hidden 64), for random weights."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )


def fake_model_info(hidden: int = 8, fingerprint: str = "0123456789abcdef", name: str = "fake") -> ModelInfo:
    """The facts of a model that is never loaded: memories built for it need only ``hidden``."""
    return ModelInfo(
        name=name,
        path="/nowhere",
        model_type="llama",
        hidden_size=hidden,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=10,
        max_context=128,
        dtype="float32",
        device="cpu",
        fingerprint=fingerprint,
    )


def fake_memory(
    info: ModelInfo,
    namespace: str = "default",
    seed: int = 0,
    *,
    keys: dict | None = None,
    memory_id: str | None = None,
    question: str | None = None,
    stats: TrainingStats | None = None,
) -> LatentMemory:
    """A 4-token memory of random numbers (reproducible from ``seed``) with a random ``input`` key,
    unless ``keys`` are given; ``question`` defaults to ``"question {seed}?"`` and ``stats`` to a
    3-step run whose majority answer is 42."""
    g = torch.Generator().manual_seed(seed)
    m = LatentMemory.create(
        torch.randn(4, info.hidden_size, generator=g),
        question=question if question is not None else f"question {seed}?",
        namespace=namespace,
        model=info,
        stats=stats if stats is not None else TrainingStats(steps=3, majority_answer="42", majority_share=0.5),
        memory_id=memory_id,
    )
    m.keys = keys if keys is not None else {"input": torch.randn(info.hidden_size, generator=g)}
    return m


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the block, restored after: on a busy 2-core box, small matrices run
    several times faster on 1 thread than on 2 (measured 8x for SmolLM2-135M)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prepare_fake_model(home: Path, fingerprint: str, hidden: int = 8) -> Path:
    """A model 'prepared' under ``home`` (an $ELM_HOME): its marker (fingerprint) and a tiny llama
    config.json, no weights; what `memories import` checks memories against. Returns its folder."""
    folder = home / "models" / "fake"
    folder.mkdir(parents=True)
    (folder / "elm_model.json").write_text(json.dumps({"format": 1, "embedding_fingerprint": fingerprint}))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 10,
        "max_position_embeddings": 128,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class ScriptedRollouts:
    """A generation backend that answers every prompt with the given texts (cycled to ``params.n``), so a
    training step's rewards are known in advance; logits still come from ``real``'s model."""

    name = "scripted"

    def __init__(self, real, texts):
        self.real, self.texts = real, texts
        self.tokenizer, self.info = real.tokenizer, real.info
        self.calls: list[PromptInput] = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.extend(prompts)
        gens = []
        for i in range(params.n):
            text = self.texts[i % len(self.texts)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            gens.append(Generation(text=text, token_ids=ids, finish_reason="stop"))
        return [gens for _ in prompts]


def weights_checksum(model) -> str:
    """sha256 over every parameter's name and values: equal before and after means bit-identical weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def stream_graph_config(tmp_path, **stream):
    """cpu-tiny with a stream memory in the graph: store under ``tmp_path``, no learner, 3 consistency samples.
    ``stream``: its settings, a ``stream.tuning`` one by its name alone."""
    from elm_memory.config import ELMConfig, StreamConfig

    tuning = {k: stream.pop(k) for k in list(stream) if k not in StreamConfig.model_fields}
    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "store": {"path": str(tmp_path / "store")},
            "learner": {"mode": "off"},
            "verifier": {"name": "consistency", "consistency_samples": 3},
            "stream": {"mode": "stream", **stream, "tuning": tuning},
        },
    )
