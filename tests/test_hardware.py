"""The device/dtype/threads decision (elm_memory/hardware.py) on fake machines, and `elm env`."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from elm_memory.config import ELMConfig, ModelConfig
from elm_memory.errors import ConfigError
from elm_memory.hardware import CPUInfo, GPUInfo, Hardware, PerformanceWarning, glibc, resolve_placement


def cpu(*flags: str, name: str = "Fake CPU", physical: int = 4, usable: int = 8, arch: str = "x86_64") -> CPUInfo:
    return CPUInfo(
        name=name,
        architecture=arch,
        physical_cores=physical,
        logical_cores=8,
        usable_cores=usable,
        flags=frozenset(flags),
        torch_capability="AVX2",
    )


AVX2_EPYC = Hardware(cpu=cpu("avx2", "fma", name="AMD EPYC 7B13"))
AVX512_NO_BF16 = Hardware(cpu=cpu("avx2", "avx512f", "avx512_vnni"))
AVX512_BF16 = Hardware(cpu=cpu("avx2", "avx512f", "avx512_bf16"))
AMX = Hardware(cpu=cpu("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", name="Xeon Sapphire Rapids"))
ARM_BF16 = Hardware(cpu=cpu("neon", "bf16", arch="aarch64"))
ARM_NO_BF16 = Hardware(cpu=cpu("neon", arch="aarch64"))
H100 = Hardware(cpu=AVX2_EPYC.cpu, gpus=(GPUInfo(0, "NVIDIA H100", 79.2, "9.0", True),))
V100 = Hardware(cpu=AVX2_EPYC.cpu, gpus=(GPUInfo(0, "Tesla V100", 31.7, "7.0", False),))


def place(hw: Hardware, **model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = resolve_placement(ModelConfig(**model), hw)
    return p, [w for w in caught if issubclass(w.category, PerformanceWarning)]


@pytest.mark.parametrize(
    "hw, device, dtype",
    [
        (AVX2_EPYC, "cpu", "float32"),
        (AVX512_NO_BF16, "cpu", "float32"),
        (AVX512_BF16, "cpu", "bfloat16"),
        (AMX, "cpu", "bfloat16"),
        (ARM_BF16, "cpu", "bfloat16"),
        (ARM_NO_BF16, "cpu", "float32"),
        (H100, "cuda", "bfloat16"),
        (V100, "cuda", "float16"),
    ],
)
def test_auto_dtype_follows_the_hardware(hw, device, dtype):
    p, caught = place(hw)  # the defaults: device auto, dtype auto
    assert (p.device, p.dtype) == (device, dtype)
    assert not caught
    assert any(r.startswith("dtype auto") for r in p.reasons)


def test_auto_never_picks_float16_on_a_cpu():
    for hw in (AVX2_EPYC, AVX512_NO_BF16, AVX512_BF16, AMX, ARM_BF16, ARM_NO_BF16, H100, V100):
        p, _ = place(hw, device="cpu")
        assert p.dtype in ("float32", "bfloat16")


def test_explicit_bf16_on_an_avx2_cpu_works_with_one_warning_that_says_how_to_fix_it():
    p, caught = place(AVX2_EPYC, dtype="bfloat16")
    assert p.dtype == "bfloat16"  # honoured: the user asked for it
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "AMD EPYC 7B13" in msg and "slower than float32" in msg and "model.dtype" in msg


def test_explicit_bf16_where_it_is_native_does_not_warn():
    _, caught = place(AMX, dtype="bfloat16")
    assert not caught


def test_explicit_fp16_on_a_cpu_warns():
    p, caught = place(AVX512_BF16, dtype="float16")
    assert p.dtype == "float16" and len(caught) == 1


def test_threads_default_to_physical_cores_within_the_affinity():
    assert place(AVX2_EPYC)[0].num_threads == 4  # 4 physical, 8 usable
    narrow = Hardware(cpu=cpu("avx2", physical=4, usable=2))
    assert place(narrow)[0].num_threads == 2  # a container limited to 2 cores


def test_explicit_threads_are_honoured_and_oversubscription_warns():
    p, caught = place(AVX2_EPYC, num_threads=3)
    assert p.num_threads == 3 and not caught
    p, caught = place(AVX2_EPYC, num_threads=64)
    assert p.num_threads == 64 and len(caught) == 1 and "exceeds" in str(caught[0].message)


@pytest.mark.parametrize(
    "override", [{"dtype": "fp8"}, {"dtype": "bf16"}, {"num_threads": 0}, {"num_threads": -2}, {"num_threads": "many"}]
)
def test_unknown_dtype_or_thread_count_is_a_config_error(override):
    with pytest.raises(ConfigError):
        ELMConfig.load(overrides={"model": override})


def test_presets_do_not_hard_code_a_cpu_dtype():
    for preset in ("cpu-demo", "cpu-tiny"):
        assert ELMConfig.load(preset=preset).model.dtype == "auto"


def test_this_machine_is_detected_consistently():
    hw = Hardware.detect()
    assert hw.cpu.physical_cores >= 1 and hw.cpu.usable_cores >= 1
    p = resolve_placement(ModelConfig(device="cpu"), hw, warn=False)
    assert p.dtype == ("bfloat16" if hw.cpu.fast_bf16 else "float32")


def test_elm_env_json_has_what_a_bug_report_needs():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elm_memory.cli",
            "env",
            "--json",
            "--set",
            "model.dtype=float32",
            "--set",
            "model.num_threads=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert {"platform", "cpu", "gpus", "resolved", "packages"} <= report.keys()
    assert {"name", "physical_cores", "logical_cores", "flags", "torch_capability", "fast_bf16"} <= report["cpu"].keys()
    assert {"avx2", "avx512_bf16", "amx_bf16"} <= report["cpu"]["flags"].keys() or report["cpu"][
        "architecture"
    ] != "x86_64"
    resolved = report["resolved"]
    assert (resolved["device"], resolved["dtype"], resolved["num_threads"]) == ("cpu", "float32", 1)
    assert resolved["backend"] == "hf" and resolved["cpu_allocator"] in ("reuse", "system")
    for pkg in ("torch", "transformers", "trl", "peft", "vllm", "chromadb", "langgraph", "langchain-core"):
        assert pkg in report["packages"]
    assert report["packages"]["torch"].startswith("2.")


def test_elm_env_text_names_the_decision():
    r = subprocess.run(
        [sys.executable, "-m", "elm_memory.cli", "env", "--set", "model.dtype=float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "dtype float32 (requested float32)" in r.stdout and "torch cpu path" in r.stdout
    assert "code            elm-memory " in r.stdout


def test_attention_kernel_follows_the_device_unless_set():
    assert place(AVX2_EPYC)[0].attn_implementation == "eager"
    assert place(AVX512_BF16)[0].attn_implementation == "eager"  # the EPYC where SDPA decoded slower
    assert place(AMX)[0].attn_implementation == "sdpa"  # measured faster there
    assert place(H100)[0].attn_implementation == "sdpa"
    assert place(AMX, attn_implementation="eager")[0].attn_implementation == "eager"
    assert place(AVX2_EPYC, attn_implementation="sdpa")[0].attn_implementation == "sdpa"


def test_allocator_reuses_freed_buffers_on_a_glibc_cpu_only(monkeypatch):
    import elm_memory.hardware as hardware

    monkeypatch.setattr(hardware, "glibc", lambda: True)
    assert place(AMX)[0].cpu_allocator == "reuse"
    assert place(AVX2_EPYC, cpu_allocator="reuse")[0].cpu_allocator == "reuse"
    assert place(AMX, cpu_allocator="system")[0].cpu_allocator == "system"
    assert place(H100)[0].cpu_allocator == "system"  # the GPU run's host side is left alone
    monkeypatch.setattr(hardware, "glibc", lambda: False)
    p, caught = place(AMX)
    assert p.cpu_allocator == "system" and not caught
    p, caught = place(AMX, cpu_allocator="reuse")
    assert p.cpu_allocator == "system" and len(caught) == 1 and "glibc" in str(caught[0].message)


def test_weights_are_prepacked_on_a_cpu_in_bf16_unless_set():
    assert place(AMX)[0].weight_prepack  # auto: bf16 on this CPU
    assert not place(AVX2_EPYC)[0].weight_prepack  # auto: float32 there, whose rounding packing changes
    assert place(AVX2_EPYC, cpu_weight_prepack="on")[0].weight_prepack
    assert not place(AMX, cpu_weight_prepack="off")[0].weight_prepack
    assert not place(H100)[0].weight_prepack and not place(H100, cpu_weight_prepack="on")[0].weight_prepack
    p, caught = place(AMX, dtype="float16", cpu_weight_prepack="on")
    assert not p.weight_prepack and any("float16" in str(w.message) for w in caught)
    with pytest.raises(ConfigError):
        ELMConfig.load(overrides={"model": {"cpu_weight_prepack": "yes please"}})


def test_a_bare_off_on_the_command_line_is_the_word_not_yamls_false():
    from elm_memory.config.loading import parse_overrides

    cfg = ELMConfig.load(overrides=parse_overrides(["model.cpu_weight_prepack=off", "backend.decode_graphs=off"]))
    assert cfg.model.cpu_weight_prepack == "off" and cfg.backend.decode_graphs == "off"
    cfg = ELMConfig.load(overrides=parse_overrides(["model.cpu_weight_prepack=on", "backend.decode_graphs=on"]))
    assert cfg.model.cpu_weight_prepack == "on" and cfg.backend.decode_graphs == "on"


def test_unknown_allocator_is_a_config_error():
    with pytest.raises(ConfigError):
        ELMConfig.load(overrides={"model": {"cpu_allocator": "jemalloc"}})


_FAULTS = """
import resource, sys, torch
from elm_memory.hardware import Placement, apply_allocator
took = apply_allocator(Placement("cpu", "float32", 1, cpu_allocator=sys.argv[1]))
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(64 * 151936, dtype=torch.float32).fill_(1.0)  # a 64-row step's float32 logits, freed at once
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, min(faults[-4:]))  # glibc may place the first few apart before it settles
"""


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_reuse_stops_a_freed_logits_buffer_from_faulting_in_again():
    def run(mode: str) -> tuple[str, int]:
        r = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        took, faults = r.stdout.split()
        return took, int(faults)

    took, reused = run("reuse")
    assert took == "True"
    kept, fresh = run("system")
    assert kept == "False"
    # 39 MB is about 9,500 pages of 4 KiB: faulted in again on every allocation unless the buffer is kept
    assert fresh > 2000 and reused < fresh / 20, (fresh, reused)


def test_code_version_names_the_commit_of_the_running_source(monkeypatch):
    from pathlib import Path

    import elm_memory
    from elm_memory import environment

    code = environment.code_version()
    source = Path(elm_memory.__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (the tests' own); an installed wheel has no commit
        assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    assert environment.format_code({"version": "0.1.0", "commit": "4b26fa7aa", "dirty": True}) == (
        "0.1.0, commit 4b26fa7 (uncommitted changes)"
    )
    assert environment.format_code({"version": "0.1.0", "commit": None, "dirty": None}) == "0.1.0"

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(environment.subprocess, "run", no_git)
    assert environment.code_version()["commit"] is None  # no git: the version alone, no error


def test_elm_env_says_when_other_work_holds_the_cores(monkeypatch):
    from elm_memory import environment

    monkeypatch.setattr(environment.os, "getloadavg", lambda: (2.04, 1.5, 0.75))
    busy = environment.cpu_load(2)
    assert busy == {"load_1min": 2.04, "load_5min": 1.5, "load_15min": 0.75, "busy": True}
    assert environment.format_load(busy, 2) == (
        "2.04 1.50 0.75 (1, 5, 15 min) on 2 usable cores: busy (other work holds the cores: timings now are slowed)"
    )
    monkeypatch.setattr(environment.os, "getloadavg", lambda: (0.9, 0.4, 0.2))
    assert environment.cpu_load(2)["busy"] is False  # under half the cores: quiet enough to time
    assert environment.cpu_load(1)["busy"] is True
    assert environment.format_load(environment.cpu_load(2), 2).endswith("on 2 usable cores: quiet")

    def no_load_average():
        raise OSError("no load average here")

    monkeypatch.setattr(environment.os, "getloadavg", no_load_average)
    assert environment.cpu_load(2) is None
    assert environment.format_load(None, 2) == "not reported by this system"


def test_elm_env_text_has_the_load_line(monkeypatch):
    from elm_memory import environment
    from elm_memory.config import ELMConfig

    monkeypatch.setattr(environment.os, "getloadavg", lambda: (0.1, 0.2, 0.3))
    text = environment.format_env(environment.collect_env(ELMConfig()))
    assert "\nload            0.10 0.20 0.30 (1, 5, 15 min) on " in text and text.count("usable cores: quiet") == 1
