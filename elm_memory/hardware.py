"""What this machine can do, and the one place that turns it into device, dtype and threads.

Why it matters: on CPUs without AMX or AVX512-BF16 (AVX2 only), PyTorch runs bf16 matmuls in
its reference kernel, measured 10-60x slower than fp32 (docs/performance.md). On CPUs that have them, bf16 is
several times *faster* than fp32. So ``model.dtype: auto`` (the default) asks the
hardware, and every loader (transformers, vLLM, the PRM) calls :func:`resolve_placement`
instead of reading ``model.dtype`` itself.

Tests pass a fake :class:`Hardware` to :func:`resolve_placement`; nothing here imports
torch at module level.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

#: CPU features with which PyTorch (oneDNN) runs bf16 matmuls natively.
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
#: The CPU features a performance bug report needs (names as /proc/cpuinfo and torch spell them).
REPORTED_CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "neon",
    "sve",
    "bf16",
)
#: The slowdown of bf16 against fp32 measured on an AVX2-only CPU (docs/performance.md).
BF16_FALLBACK_SLOWDOWN = "10-60x"


class PerformanceWarning(UserWarning):
    """A setting that works but is known to be much slower than an alternative on this machine."""


@dataclass(frozen=True)
class CPUInfo:
    name: str
    architecture: str
    physical_cores: int
    logical_cores: int
    usable_cores: int  # what this process may run on (affinity / container limits)
    flags: frozenset[str] = frozenset()
    torch_capability: str | None = None  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...

    @property
    def fast_bf16(self) -> bool:
        """True when bf16 matmuls run in native kernels (AMX or AVX512-BF16; Arm's BF16 extension)."""
        if self.architecture in ("aarch64", "arm64"):
            return "bf16" in self.flags
        return any(f in self.flags for f in FAST_BF16_CPU_FLAGS)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["flags"] = {f: f in self.flags for f in REPORTED_CPU_FLAGS if _flag_applies(f, self.architecture)}
        out["fast_bf16"] = self.fast_bf16
        return out


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    total_memory_gib: float
    compute_capability: str
    bf16: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Hardware:
    cpu: CPUInfo
    gpus: tuple[GPUInfo, ...] = ()

    @staticmethod
    def detect() -> Hardware:
        """This machine (cached: the hardware does not change while a process runs)."""
        return _detect()

    def gpu(self, device: str) -> GPUInfo | None:
        if not device.startswith("cuda"):
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return next((g for g in self.gpus if g.index == index), None)

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu.to_dict(), "gpus": [g.to_dict() for g in self.gpus]}


@dataclass(frozen=True)
class Placement:
    """Where and how the model runs, and why."""

    device: str
    dtype: str  # "bfloat16" | "float32" | "float16"
    num_threads: int
    attn_implementation: str = "sdpa"  # transformers' attention kernel: "eager" | "sdpa"
    cpu_allocator: str = "system"  # "reuse": glibc keeps large freed buffers (see apply_allocator) | "system"
    weight_prepack: bool = False  # frozen linear weights kept in oneDNN's layout (models/prepack.py)
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def summary(self) -> str:
        return (
            f"{self.device}, {self.dtype}, {self.num_threads} threads, {self.attn_implementation} attention, "
            f"{self.cpu_allocator} allocator, {'prepacked' if self.weight_prepack else 'plain'} weights "
            f"({'; '.join(self.reasons)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_placement(model_cfg: Any, hardware: Hardware | None = None, *, warn: bool = True) -> Placement:
    """Device, dtype and CPU threads for a :class:`~elm_memory.config.ModelConfig`.

    ``auto`` dtype: bf16 on CUDA devices that support it (fp16 on older GPUs), bf16 on
    CPUs with AMX or AVX512-BF16, fp32 on every other CPU; never fp16 on a CPU. An
    explicit dtype is honoured; if it is known to be slow here, one
    :class:`PerformanceWarning` says so and how to change it.
    """
    hw = hardware or Hardware.detect()
    reasons: list[str] = []
    notes: list[str] = []

    device = resolve_device(model_cfg.device, hw)
    if model_cfg.device == "auto":
        reasons.append("device auto: " + ("CUDA is available" if hw.gpus else "no CUDA device"))
    dtype = _resolve_dtype(model_cfg.dtype, device, hw, reasons, notes)
    threads = _resolve_threads(model_cfg.num_threads, hw.cpu, reasons, notes)
    attn = getattr(model_cfg, "attn_implementation", "auto")
    if attn == "auto":
        attn, why = _resolve_attention(device, hw.cpu)
        reasons.append(f"attention auto: {attn} ({why})")

    allocator = _resolve_allocator(getattr(model_cfg, "cpu_allocator", "auto"), device, reasons, notes)
    prepack = _resolve_prepack(getattr(model_cfg, "cpu_weight_prepack", "auto"), device, dtype, reasons, notes)

    if warn:
        for note in notes:
            warnings.warn(note, PerformanceWarning, stacklevel=2)
    return Placement(
        device=device,
        dtype=dtype,
        num_threads=threads,
        attn_implementation=attn,
        cpu_allocator=allocator,
        weight_prepack=prepack,
        reasons=tuple(reasons),
        warnings=tuple(notes),
    )


def _resolve_attention(device: str, cpu: CPUInfo) -> tuple[str, str]:
    """transformers' attention kernel for ``device``, and why. Measured per CPU kind with
    ``python -m benchmarks.attention_kernel`` (docs/performance.md): SDPA is faster than eager on CPUs
    with AMX and slower on one with AVX512-BF16 but no AMX. Other CPUs keep eager."""
    if device.startswith("cuda"):
        return "sdpa", "CUDA"
    if "amx_bf16" in cpu.flags:
        return "sdpa", "faster than eager on AMX CPUs"
    return "eager", "faster than sdpa on the non-AMX CPUs measured"


def _resolve_dtype(requested: str, device: str, hw: Hardware, reasons: list[str], notes: list[str]) -> str:
    """The dtype for ``device``; appends why to ``reasons`` and a slow explicit choice to ``notes``."""
    on_cuda = device.startswith("cuda")
    gpu = hw.gpu(device)
    cpu = hw.cpu
    if requested == "auto":
        if on_cuda:
            bf16 = gpu is None or gpu.bf16  # an unknown GPU: let torch decide at load time
            reasons.append(f"dtype auto: {gpu.name if gpu else device} " + ("supports bf16" if bf16 else "has no bf16"))
            return "bfloat16" if bf16 else "float16"
        if cpu.fast_bf16:
            native = [f for f in (*FAST_BF16_CPU_FLAGS, "bf16") if f in cpu.flags]
            reasons.append(f"dtype auto: CPU has {'/'.join(native)}")
            return "bfloat16"
        reasons.append("dtype auto: CPU has no AMX or AVX512-BF16, bf16 would be slow")
        return "float32"
    dtype = requested
    reasons.append(f"dtype {dtype} set in config")
    if not on_cuda and dtype == "bfloat16" and not cpu.fast_bf16:
        notes.append(
            f"model.dtype=bfloat16 on a CPU without AMX or AVX512-BF16 ({cpu.name}, {cpu.torch_capability}): "
            f"PyTorch falls back to reference bf16 kernels, measured {BF16_FALLBACK_SLOWDOWN} slower than "
            "float32 on such CPUs. Set model.dtype: auto (or float32), e.g. --set model.dtype=auto"
        )
    elif not on_cuda and dtype == "float16" and "avx512_fp16" not in cpu.flags and "amx_fp16" not in cpu.flags:
        notes.append(
            f"model.dtype=float16 on a CPU ({cpu.name}) without native fp16 matmuls is slow and loses range; "
            "set model.dtype: auto (or float32)"
        )
    elif on_cuda and dtype == "bfloat16" and gpu is not None and not gpu.bf16:
        notes.append(f"model.dtype=bfloat16 on {gpu.name}, which has no native bf16; use auto (float16)")
    return dtype


def _resolve_threads(requested: int | None, cpu: CPUInfo, reasons: list[str], notes: list[str]) -> int:
    """torch intra-op threads: as configured (a note when past the usable cores), else one per physical core."""
    if requested is not None:
        reasons.append(f"{requested} threads set in config")
        if requested > cpu.usable_cores:
            notes.append(
                f"model.num_threads={requested} exceeds the {cpu.usable_cores} cores this process may use; "
                "oversubscribed threads slow every matmul"
            )
        return requested
    threads = max(1, min(cpu.physical_cores, cpu.usable_cores))
    reasons.append(f"{threads} threads: one per physical core")
    return threads


def _resolve_allocator(requested: str, device: str, reasons: list[str], notes: list[str]) -> str:
    """``reuse`` or ``system`` (see :func:`apply_allocator`); ``auto`` reuses on a CPU device with glibc."""
    if device.startswith("cuda"):
        return "system"  # the CPU side of a GPU run allocates little; leave the process as it is
    if requested == "system":
        return "system"
    if not glibc():
        if requested == "reuse":
            notes.append("model.cpu_allocator=reuse needs glibc's malloc; this process has another, left as it is")
        else:
            reasons.append("allocator auto: system (not glibc)")
        return "system"
    reasons.append(f"allocator {requested}: reuse large freed buffers")
    return "reuse"


def _resolve_prepack(requested: str, device: str, dtype: str, reasons: list[str], notes: list[str]) -> bool:
    """Whether frozen linear weights are reordered once for oneDNN (``models/prepack.py``); CPU only.
    ``auto`` only in bf16: the CPUs that run bf16 natively are the ones measured faster with it."""
    if device.startswith("cuda") or requested == "off":
        return False
    if requested == "on":
        if dtype == "float16":
            notes.append("model.cpu_weight_prepack=on is not used in float16 on a CPU; weights left as they are")
            return False
        reasons.append("weights prepack on")
        return True
    if dtype != "bfloat16":
        return False
    reasons.append("weights prepack auto: bf16 on a CPU")
    return True


#: The most rows of one decode call the one-row engine takes (``elm_memory/backends/int4.py``'s ``MAX_ROWS``).
ONE_ROW_MAX_ROWS = 2
#: ``llama_missing`` when nobody checked llama.cpp (the setting cannot pick it): no reason to report.
NOT_ASKED = "not asked"


def resolve_one_row_engine(
    requested: str,
    placement: Placement,
    *,
    backend: str = "hf",
    decode_loop: str = "elm",
    llama_missing: str | None = NOT_ASKED,
) -> tuple[str, str]:
    """The engine of the ``hf`` backend's decode calls of at most :data:`ONE_ROW_MAX_ROWS` rows
    (``backend.one_row_engine``), and why: ``llama`` (llama.cpp on the model's GGUF,
    ``elm_memory/backends/llama_rows.py``), ``int4`` (torch's int4 weight-only CPU kernels,
    ``elm_memory/backends/int4.py``) or ``plain`` (the library's loop on the loaded weights).

    ``llama_missing``: why llama.cpp cannot serve this model here (None: it can). ``auto`` picks llama.cpp
    where it can, else int4 on a CPU device in bfloat16 where torch has the kernels: a step at one row is bound
    by reading the weights there, and both were measured only against that bf16 loop (docs/performance.md)."""
    if requested == "plain":
        return "plain", "backend.one_row_engine: plain"
    if backend != "hf":
        return "plain", f"the {backend} backend decodes by itself"
    if decode_loop != "elm":
        return "plain", f"backend.decode_loop={decode_loop} has no one-row engine"
    if placement.device.startswith("cuda"):
        return "plain", "the one-row engines run CPU kernels"
    if requested == "llama":
        if llama_missing is not None:
            return "plain", f"backend.one_row_engine: llama, but {llama_missing}"
        return "llama", f"backend.one_row_engine: llama, calls of at most {ONE_ROW_MAX_ROWS} rows"
    if requested == "auto" and llama_missing is None:
        return "llama", f"auto: llama.cpp on the model's GGUF, calls of at most {ONE_ROW_MAX_ROWS} rows"
    no_llama = f" (llama.cpp: {llama_missing})" if requested == "auto" and llama_missing != NOT_ASKED else ""
    if not _int4_kernels():
        return "plain", f"this torch has no int4 CPU kernels{no_llama}"
    if requested == "int4":
        slow = "; slow in float32 (torch's int4 kernel has no fast path there)" if placement.dtype == "float32" else ""
        return "int4", f"backend.one_row_engine: int4, calls of at most {ONE_ROW_MAX_ROWS} rows{slow}"
    if placement.dtype != "bfloat16":
        return (
            "plain",
            f"auto: the model runs in {placement.dtype}; int4 is measured against a bf16 loop only{no_llama}",
        )
    return "int4", f"auto: a CPU in bf16, calls of at most {ONE_ROW_MAX_ROWS} rows{no_llama}"


def _int4_kernels() -> bool:
    import torch

    ops = torch.ops.aten
    return hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(ops, "_weight_int4pack_mm_for_cpu")


@functools.lru_cache(maxsize=1)
def glibc() -> bool:
    """Whether this process runs on glibc (whose ``mallopt`` :func:`apply_allocator` calls)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Large enough that no buffer of a decode or learning step is mmapped (a 64-row step's float32 logits
#: are 39 MB). Where glibc refuses a threshold that high, its documented maximum (32 MiB) is used.
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)


def apply_allocator(placement: Placement) -> bool:
    """With ``placement.cpu_allocator == "reuse"``, keep large freed buffers in the process.

    Why: glibc serves every allocation above its mmap threshold (at most 32 MiB by default) with a
    fresh mmap and returns it to the system when freed, so the next one faults in every page again
    and the kernel zeroes it. A decode step allocates and frees its logits and a training step its
    activations, every step (measured: docs/performance.md). The price is a resident size that stays
    at its peak. Process-wide and idempotent; returns whether it took effect."""
    if placement.cpu_allocator != "reuse":
        return False
    return _raise_malloc_thresholds()


@functools.lru_cache(maxsize=1)
def _raise_malloc_thresholds() -> bool:
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not any(mallopt(_M_MMAP_THRESHOLD, value) for value in _MMAP_THRESHOLDS):
        return False
    mallopt(_M_TRIM_THRESHOLD, _MMAP_THRESHOLDS[0])
    return True


def resolve_device(device: str, hardware: Hardware | None = None) -> str:
    """``auto`` -> ``cuda`` when a CUDA device exists, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    return "cuda" if (hardware or Hardware.detect()).gpus else "cpu"


def apply_threads(placement: Placement) -> None:
    """Set torch's intra-op threads (CPU matmuls; on CUDA it still paces tokenisation and sampling glue)."""
    import torch

    if torch.get_num_threads() != placement.num_threads:
        torch.set_num_threads(placement.num_threads)


# ---- detection --------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _detect() -> Hardware:
    return Hardware(cpu=_detect_cpu(), gpus=_detect_gpus())


def _detect_cpu() -> CPUInfo:
    import torch

    caps: dict[str, Any] = {}
    get_caps = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.6 (cpuinfo-based)
    if get_caps is not None:
        try:
            caps = dict(get_caps())
        except Exception:  # a probe must never stop the model from loading
            caps = {}
    flags = {k for k, v in caps.items() if v is True}
    flags |= _proc_cpuinfo_flags()
    if "fma3" in flags:
        flags.add("fma")
    logical = int(caps.get("num_logical_cores") or os.cpu_count() or 1)
    physical = int(caps.get("num_physical_cores") or _physical_cores_from_proc() or logical)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical
    return CPUInfo(
        name=str(caps.get("cpu_name") or _cpu_model_name() or platform.processor() or "unknown"),
        architecture=platform.machine().lower(),
        physical_cores=physical,
        logical_cores=logical,
        usable_cores=usable,
        flags=frozenset(flags),
        torch_capability=_torch_capability(),
    )


def _detect_gpus() -> tuple[GPUInfo, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        with torch.cuda.device(i):
            bf16 = bool(torch.cuda.is_bf16_supported())
        gpus.append(
            GPUInfo(
                index=i,
                name=props.name,
                total_memory_gib=round(props.total_memory / 2**30, 1),
                compute_capability=f"{props.major}.{props.minor}",
                bf16=bf16,
            )
        )
    return tuple(gpus)


def _torch_capability() -> str | None:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None


def _proc_cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            return fh.read().splitlines()
    except OSError:
        return []


def _proc_cpuinfo_flags() -> set[str]:
    for line in _proc_cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / Arm
            return set(value.split())
    return set()


def _cpu_model_name() -> str | None:
    for line in _proc_cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def _physical_cores_from_proc() -> int | None:
    cores = set()
    phys = core = None
    for line in _proc_cpuinfo_lines() + [""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not key and core is not None:
            cores.add((phys, core))
            phys = core = None
    return len(cores) or None


def _flag_applies(flag: str, arch: str) -> bool:
    arm = arch in ("aarch64", "arm64")
    return (flag in ("neon", "sve", "bf16")) == arm
