"""Registry names in a config (verifier, key builder, store, learner mode, backend, training engine, memory
kind) are checked when the config loads, before any model work, with the choices in the message."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from typing import get_args

import pytest

from elm_memory import plugins
from elm_memory.backends.registry import backends
from elm_memory.config import ELMConfig, MemoryConfig, VerifierConfig
from elm_memory.config.loading import parse_overrides
from elm_memory.errors import ConfigError
from elm_memory.jobs.registry import learners
from elm_memory.memory.key_registry import key_builders
from elm_memory.store.registry import stores
from elm_memory.training.registry import training_engines
from elm_memory.verifiers.registry import verifiers

# (override, the registry that owns the field, names it accepts besides the registry's)
REGISTERED_FIELDS = [
    ("verifier.name=logprobs", verifiers, []),
    ("retrieval.key=bm25", key_builders, []),
    ("store.kind=redis", stores, ["none"]),
    ("backend.name=vlm", backends, []),
    ("learner.mode=syncc", learners, []),
    ("training.engine=trll", training_engines, []),
]


def load(*overrides: str, preset: str | None = None) -> ELMConfig:
    return ELMConfig.load(preset=preset, overrides=parse_overrides(overrides))


@pytest.mark.parametrize("override, registry, extra", REGISTERED_FIELDS)
def test_an_unknown_name_fails_at_load_with_the_choices(override, registry, extra):
    field, _, value = override.partition("=")
    with pytest.raises(ConfigError) as err:
        load(override)
    choices = ", ".join([*registry.names(), *extra])
    assert str(err.value).startswith(
        f"invalid config: {field}: unknown {registry.kind} {value!r}; choose one of: {choices}"
    ), str(err.value)
    assert "Value error" not in str(err.value) and "\n" not in str(err.value)


def test_a_near_miss_is_named():
    with pytest.raises(ConfigError, match=r"unknown verifier 'logprobs'.*\(did you mean 'logprob'\?\)"):
        load("verifier.name=logprobs")
    with pytest.raises(ConfigError) as err:
        load("retrieval.key=bm25")  # nothing close: no guess
    assert "did you mean" not in str(err.value)


def test_every_built_in_name_passes_the_name_check():
    for override, registry, extra in REGISTERED_FIELDS:
        field = override.partition("=")[0]
        for name in [*registry.names(), *extra]:
            cfg = load(f"{field}={name}")
            section, _, key = field.partition(".")
            assert getattr(getattr(cfg, section), key) == name


def test_a_memory_kind_outside_the_set_lists_the_set():
    kinds = get_args(MemoryConfig.model_fields["kind"].annotation)
    with pytest.raises(ConfigError) as err:
        load("memory.kind=lorax")
    assert str(err.value) == (
        f"invalid config: memory.kind: unknown memory kind 'lorax'; choose one of: {', '.join(kinds)} "
        "(did you mean 'lora'?)"
    )
    routes = get_args(VerifierConfig.model_fields["route"].annotation)
    with pytest.raises(
        ConfigError, match=f"verifier.route: unknown verifier route 'votes'; choose one of: {', '.join(routes)}"
    ):
        load("verifier.route=votes")


def test_two_bad_names_are_both_named():
    with pytest.raises(ConfigError) as err:
        load("verifier.name=logprobs", "retrieval.key=bm25")
    assert "verifier.name: unknown verifier 'logprobs'" in str(err.value)
    assert "retrieval.key: unknown key builder 'bm25'" in str(err.value)


def test_a_check_on_several_fields_has_no_pydantic_prefix():
    # cpu-demo votes on the consistency verifier's samples: the check spans two sections, so it has no
    # field of its own to be listed under (it printed "invalid config: : Value error, verifier.route=...")
    with pytest.raises(ConfigError) as err:
        load("verifier.name=self_certainty", preset="cpu-demo")
    assert str(err.value).startswith("invalid config: verifier.route=vote votes on the consistency"), str(err.value)
    assert ": :" not in str(err.value) and "Value error" not in str(err.value)


def test_a_plugin_name_from_an_entry_point_loads(monkeypatch):
    found = {
        "elm_memory.verifiers": importlib.metadata.EntryPoint("my_scorer", "my_pkg:Scorer", "elm_memory.verifiers"),
        "elm_memory.key_builders": importlib.metadata.EntryPoint("my_key", "my_pkg:Key", "elm_memory.key_builders"),
    }

    def entry_points(*, group=None, **kw):
        return [found[group]] if group in found else []

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", entry_points)
    for registry in (verifiers, key_builders):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        monkeypatch.setattr(registry, "_plugins_loaded", False)
    cfg = load("verifier.name=my_scorer", "retrieval.key=my_key")  # the plugins are not imported to check
    assert (cfg.verifier.name, cfg.retrieval.key) == ("my_scorer", "my_key")
    with pytest.raises(ConfigError, match="choose one of: .*my_scorer"):
        load("verifier.name=my_scorer2")


def test_a_name_registered_at_run_time_loads(monkeypatch):
    monkeypatch.setattr(verifiers, "_entries", dict(verifiers._entries))
    with pytest.raises(ConfigError):
        load("verifier.name=mine")
    verifiers.register("mine", "my_pkg:Mine")
    assert load("verifier.name=mine").verifier.name == "mine"


def test_checking_names_imports_no_torch():
    # the check runs before any model work: a misspelt name costs the config's import, not torch's
    code = (
        "import sys\n"
        "from elm_memory.config import ELMConfig\n"
        "from elm_memory.errors import ConfigError\n"
        "bad = {'verifier': {'name': 'x'}, 'retrieval': {'key': 'y'}}\n"
        "for overrides in (bad, {'backend': {'name': 'x'}}, {'store': {'kind': 'x'}}, "
        "{'learner': {'mode': 'x'}}, {'training': {'engine': 'x'}}):\n"
        "    try:\n"
        "        ELMConfig.load(preset='cpu-tiny', overrides=overrides)\n"
        "    except ConfigError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('loaded: ' + repr(overrides))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_config_show_refuses_a_misspelt_name():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elm_memory.cli",
            "config",
            "show",
            "--preset",
            "cpu-tiny",
            "--set",
            "retrieval.key=bm25",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: invalid config: retrieval.key: unknown key builder 'bm25'"), r.stderr
    assert r.stdout == ""
