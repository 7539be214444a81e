"""Shared fixtures. Real packaged models are prepared once per machine (cached in $ELM_HOME)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = "packaged:smollm2-135m"
DEFAULT = "packaged:qwen2.5-coder-0.5b"


def _load(name: str, dtype: str):
    from elm_memory.config import ModelConfig
    from elm_memory.models.loading import load_model
    from elm_memory.models.prepare import prepare_model

    prepare_model(name, verbose=False)
    return load_model(ModelConfig(name_or_path=name, dtype=dtype, device="cpu"))


@pytest.fixture(scope="session")
def tiny_loaded():
    """SmolLM2-135M in float32: fast, deterministic plumbing tests on real weights."""
    return _load(TINY, "float32")


@pytest.fixture(scope="session")
def default_loaded():
    """The default model (Qwen2.5-Coder-0.5B-Instruct) in the dtype users get: ``auto`` (bf16 where the
    CPU has native bf16, fp32 elsewhere; see elm_memory/hardware.py)."""
    return _load(DEFAULT, "auto")


@pytest.fixture(scope="session")
def tiny_backend(tiny_loaded):
    from elm_memory.backends.hf import HFBackend

    return HFBackend(tiny_loaded)


@pytest.fixture(scope="session")
def default_backend(default_loaded):
    from elm_memory.backends.hf import HFBackend

    return HFBackend(default_loaded)
