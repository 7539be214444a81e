"""Shared fixtures. Real packaged models are prepared once per machine (cached in $ELM_HOME)."""

from __future__ import annotations

import os

import pytest
from _fakes import one_thread

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _isolated_elm_home() -> str:
    """A temporary ``ELM_HOME`` for the test session, so that no test (nor a CLI it runs in a
    subprocess) writes into the user's memory stores (``<ELM_HOME>/store*``); its ``models`` and
    ``downloads`` link to the real cache, so prepared models are reused, not prepared again."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from elm_memory.models.prepare import elm_home

    real = elm_home()
    home = Path(tempfile.mkdtemp(prefix="elm-test-home-"))
    for name in ("models", "downloads"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    atexit.register(shutil.rmtree, home, True)  # removes the links, never what they point to
    return str(home)


os.environ["ELM_HOME"] = _isolated_elm_home()


def _config_variables() -> list[str]:
    """The ELM_ variables a config reads (ELM_VERIFIER__NAME, ELM_PRESET, ELM_SET, ...): every
    ``ELMConfig.load`` and ``elm`` command applies them, so a developer's shell would change the results."""
    from elm_memory.config import ELMConfig
    from elm_memory.config.env_settings import config_variables

    return config_variables(ELMConfig, os.environ)


for _name in _config_variables():  # here, not in a fixture: session fixtures and subprocesses load configs too
    del os.environ[_name]


@pytest.fixture(autouse=True)
def no_config_variables():
    """A test's own settings variables end with it (monkeypatch.setenv ones already do; this catches the rest)."""
    yield
    for name in _config_variables():
        os.environ.pop(name, None)


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


@pytest.fixture(scope="module")
def smol(tiny_loaded):
    """The session's SmolLM2-135M, run on one thread for the module: 2 threads on a busy 2-core box
    were measured 8x slower than 1."""
    with one_thread():
        yield tiny_loaded


@pytest.fixture(scope="session")
def tiny_backend(tiny_loaded):
    from elm_memory.backends.hf import HFBackend

    return HFBackend(tiny_loaded)


@pytest.fixture(scope="session")
def default_backend(default_loaded):
    from elm_memory.backends.hf import HFBackend

    return HFBackend(default_loaded)


@pytest.fixture
def evidence_config():
    """cpu-tiny with the consistency verifier (3 samples) and 8-token answers, rollouts and samples: the
    evidence tests' stream settings."""
    from elm_memory.config import ELMConfig

    return ELMConfig.load(
        preset="cpu-tiny",
        overrides={
            "generation": {"max_new_tokens": 8},
            "training": {"max_completion_length": 8},
            "verifier": {"name": "consistency", "consistency_samples": 3, "consistency_max_new_tokens": 8},
            "retrieval": {"skip_no_consensus": False},  # SmolLM2 never boxes: its rollouts never agree
        },
    )
