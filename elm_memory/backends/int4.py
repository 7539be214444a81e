"""One- and two-row decode on torch's int4 weight-only kernels (``backend.one_row_engine``).

Why: at one row a CPU decode step of the plain loop reads every bf16 linear weight once, and that read is
the step (docs/performance.md). torch's int4 weight-only CPU kernels
(``aten._weight_int4pack_mm_for_cpu``: 4-bit codes, a scale and a zero per group of input weights) read
about a quarter of those bytes. At eight rows and more a step is bound by arithmetic and the plain loop
wins, so the backend takes this path only for calls of at most :data:`MAX_ROWS` rows.

What it is: :func:`int4_model` makes, once per process and model, a second module tree of the loaded
model that shares every module, weight and buffer of the original except its linear layers, each of which
becomes an :class:`Int4Linear`: the same ``nn.Linear`` (same shared bf16 ``weight`` for anything that
reads it), whose no-grad CPU forward multiplies by its int4 copy instead. The original model is never
changed, so other threads (a learner training, a verifier scoring) keep the bf16 weights.

A forward of more than :data:`INT4_MAX_TOKENS` tokens (a call's prefill) runs each layer's own bf16 product:
the kernel's arithmetic grows with the tokens and oneDNN's product is faster there. So a call's prompt KV
cache is the plain loop's, and so is its first token while the output layer is kept. In float32 the kernel
takes a slow path (slower than the plain loop), which is why ``auto`` picks int4 only in bf16.

What it serves: the backend runs the plain loop itself (:func:`elm_memory.backends.decode.sample`) on
that tree, so a call keeps everything the loop does: greedy and seeded sampling, stop at the answer, soft
prompts (input embeddings from the shared bf16 table), lookup drafts, and LoRA memories, whose forward
hooks land on the :class:`Int4Linear` modules and add their delta in torch on top of the int4 product.
A prefix memory is refused (:func:`unserved_reason`): its keys and values come from the bf16
projections, and it is untested on int4; the backend decodes it in the plain loop and logs that once.

Quantization: group-wise asymmetric, from the loaded weights (for the packaged models, the dequantized
GGUF values the plain loop runs): per group of :data:`GROUP_SIZE` input weights, ``scale = (max - min) /
15`` and codes ``round((w - min) / scale)``; the kernel computes ``(code - 8) * scale + zero``, so the
stored zero is ``min + 8 * scale`` (both in the model's dtype). The output layer (``lm_head``) stays as it
is unless asked (``lm_head=True``); the input embeddings always do.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from elm_memory.hardware import ONE_ROW_MAX_ROWS
from elm_memory.memory.kinds import LORA, LORA_ROWS
from elm_memory.memory.lora import LoraAdapter

log = logging.getLogger(__name__)

#: The most rows (prompts x samples) of one decode call that the int4 engine takes; more go to the plain loop.
MAX_ROWS = ONE_ROW_MAX_ROWS
#: Input weights per scale and zero (the kernel takes 32, 64, 128 or 256; smaller groups fit better, cost more).
GROUP_SIZE = 32
#: A forward of more tokens than this (a prefill) runs the layer's own product: the int4 kernel's arithmetic grows
#: with the tokens while reading the weights does not, and above a few tokens oneDNN's bf16 product is faster.
INT4_MAX_TOKENS = 8
#: Memory kinds the engine applies (their forward hooks land on the int4 modules); others take the plain loop.
SERVED_MEMORY_KINDS = (LORA, LORA_ROWS)
_PACK_ROWS = 4096  # rows packed per kernel call: bounds the float32 temporaries of a large output layer
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unserved_reason(memory: Any) -> str | None:
    """Why the int4 engine does not decode a call under ``memory`` (None: it does)."""
    if memory is None or memory.kind in SERVED_MEMORY_KINDS:
        return None
    return (
        f"a {memory.kind} memory takes the plain loop: its cache was made by the bf16 projections and it is "
        "untested on int4 weights"
    )


def quantizable(linear: torch.nn.Linear, group: int) -> bool:
    """Whether the kernel takes this layer: CPU, a float dtype, ``in_features`` a multiple of ``group`` and
    ``out_features`` of 16."""
    w = linear.weight
    return (
        w.device.type == "cpu"
        and w.dtype in _DTYPES
        and linear.in_features % group == 0
        and linear.out_features % 16 == 0
    )


@torch.no_grad()
def quantize(
    weight: torch.Tensor, group: int = GROUP_SIZE, *, values: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``weight`` (out, in) as the kernel's packed int4 codes, its (in / group, out, 2) scales and zeros in
    ``weight``'s dtype and, with ``values``, the (out, in) weights they stand for (what tests compare with).

    Scales and zeros are rounded to the weight's dtype before the codes are chosen, so the codes are the best
    ones for the values the kernel will use."""
    n, k = weight.shape
    packed: list[torch.Tensor] = []
    scale_zero: list[torch.Tensor] = []
    stands_for: list[torch.Tensor] = []
    for start in range(0, n, _PACK_ROWS):
        w = weight[start : start + _PACK_ROWS].float().reshape(-1, k // group, group)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(weight.dtype).float()
        zero = (lo + 8 * scale).to(weight.dtype).float()
        codes = (torch.round((w - zero) / scale) + 8).clamp(0, 15)
        if values:
            stands_for.append(((codes - 8) * scale + zero).reshape(-1, k).to(weight.dtype))
        codes = codes.reshape(-1, k).to(torch.int32).contiguous()
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scale_zero.append(torch.cat([scale, zero], -1).transpose(0, 1))  # (groups, rows, 2)
    sz = torch.cat(scale_zero, 1).to(weight.dtype).contiguous()
    return torch.cat(packed), sz, torch.cat(stands_for) if values else None


class Int4Linear(torch.nn.Linear):
    """An ``nn.Linear`` that shares the original layer's weight and bias and, in a no-grad CPU forward of at
    most :data:`INT4_MAX_TOKENS` tokens in the weight's dtype (a decode step), multiplies by its int4 copy
    instead. Any other forward (a prefill, a graph, another device) is the original layer's own ``forward``
    (oneDNN's packed weight where the model has one; never its hooks).

    It is an ``nn.Linear`` with the original ``weight``, so LoRA hooks, ``isinstance`` checks and anything
    reading ``weight.dtype`` see the layer they saw before."""

    group: int
    _packed: torch.Tensor
    _scale_zero: torch.Tensor
    _dense: torch.nn.Linear

    def __init__(self, linear: torch.nn.Linear, group: int = GROUP_SIZE, quantized_from: torch.Tensor | None = None):
        """``quantized_from``: the weights the int4 copy stands for, when not the layer's own (a merged LoRA)."""
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight of its own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: no copy of the bf16 weight
        self.bias = linear.bias
        self.group = group
        source = linear.weight.detach() if quantized_from is None else quantized_from
        self._packed, self._scale_zero, _ = quantize(source, group)
        self.__dict__["_dense"] = linear  # not a submodule: the int4 tree's modules stay the model's own list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dense.forward(x) if self._takes_dense(x) else self._int4(x)

    def _takes_dense(self, x: torch.Tensor) -> bool:
        return (
            torch.compiler.is_compiling()
            or x.device.type != "cpu"
            or x.dtype != self._scale_zero.dtype
            or (x.requires_grad and torch.is_grad_enabled())
            or x.numel() > INT4_MAX_TOKENS * self.in_features
        )

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._packed, self.group, self._scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4 group={self.group}"


class LoraInt4Linear(Int4Linear):
    """An :class:`Int4Linear` with a LoRA merged in: its int4 copy holds ``W + scale * B @ A``, so a decode step
    pays no delta of its own; a dense forward (a prefill) adds the delta in torch to the layer's own product.

    Why: with the delta added by forward hooks, a one-row step of the default model costs about 20 ms more than
    without a memory (about 170 hooked layers, two small products each); merged, a step costs what it does
    without one. The codes are chosen for the merged weights, so the memory's delta is not rounded away as a
    separate small tensor would be."""

    def __init__(self, linear: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float, group: int):
        w = linear.weight.detach()
        merged = (w.float() + scale * (b.detach().float() @ a.detach().float())).to(w.dtype)
        super().__init__(linear, group, quantized_from=merged)
        self._a, self._b, self._delta_scale = a.detach().to(w.dtype), b.detach().to(w.dtype), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._takes_dense(x):
            return self._int4(x)
        delta = F.linear(F.linear(x, self._a.to(x.dtype)), self._b.to(x.dtype))
        return self._dense.forward(x) + delta * self._delta_scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora merged"


def _tree_with(module: torch.nn.Module, replaced: dict[str, torch.nn.Module], prefix: str = "") -> torch.nn.Module:
    """``module`` with the submodules named in ``replaced`` swapped, as new objects along their paths only:
    every other module (embeddings, norms, rotary tables, untouched linears) is the original object."""
    if prefix in replaced:
        return replaced[prefix]
    below = prefix + "." if prefix else ""
    if not any(name.startswith(below) for name in replaced):
        return module
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():  # own containers (children, parameters, hooks), same contents
        if isinstance(value, dict | set):
            clone.__dict__[key] = copy.copy(value)
    children = clone.__dict__["_modules"]
    for name, child in module.named_children():
        children[name] = _tree_with(child, replaced, below + name)
    return clone


_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, bool], torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def int4_model(model: torch.nn.Module, *, group: int = GROUP_SIZE, lm_head: bool = False) -> torch.nn.Module:
    """The int4 tree of ``model`` (see the module docstring), made on first use and cached per model, group
    size and ``lm_head`` choice for the life of the model. ``lm_head``: also quantize the output layer."""
    with _LOCK:
        made = _CACHE.setdefault(model, {})
        key = (group, lm_head)
        if key not in made:
            t0 = time.perf_counter()
            output_layer = getattr(model, "get_output_embeddings", None)
            head = output_layer() if callable(output_layer) else None
            replaced: dict[str, torch.nn.Module] = {
                name: Int4Linear(m, group)
                for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)
                and not isinstance(m, Int4Linear)
                and (lm_head or m is not head)
                and quantizable(m, group)
            }
            made[key] = _tree_with(model, replaced)
            log.info(
                "int4 engine: %d linear layers quantized (group %d, lm_head %s) in %.1f s",
                len(replaced),
                group,
                "int4" if lm_head else "kept",
                time.perf_counter() - t0,
            )
        return made[key]


_MERGED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, bool], tuple[str, torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def int4_lora_model(
    model: torch.nn.Module, adapter: LoraAdapter, *, group: int = GROUP_SIZE, lm_head: bool = False
) -> torch.nn.Module | None:
    """The int4 tree of ``model`` with ``adapter`` merged into the layers it targets (:class:`LoraInt4Linear`),
    the other layers shared with :func:`int4_model`'s tree. One merged tree is kept per model, group size and
    ``lm_head`` choice (the newest LoRA asked for: a served stream memory asks for the same version many times).
    None when a target layer cannot be quantized (the caller applies the LoRA by hooks then)."""
    modules = adapter.check_model(model)
    if not all(quantizable(m, group) for m in modules.values()):
        return None
    key, digest = (group, lm_head), adapter.digest()  # by content (a copy a version)
    with _LOCK:
        cached = _MERGED.get(model, {}).get(key)
        if cached is not None and cached[0] == digest:
            return cached[1]
    base = int4_model(model, group=group, lm_head=lm_head)
    t0 = time.perf_counter()
    replaced: dict[str, torch.nn.Module] = {n: m for n, m in base.named_modules() if isinstance(m, Int4Linear)}
    for name, linear in modules.items():
        a, b = adapter.weights[name]
        replaced[name] = LoraInt4Linear(linear, a, b, adapter.scale, group)
    tree = _tree_with(model, replaced)
    with _LOCK:
        _MERGED.setdefault(model, {})[key] = (digest, tree)
    log.info("int4 engine: a lora merged into %d layers in %.1f s", len(modules), time.perf_counter() - t0)
    return tree


def int4_bytes(model: torch.nn.Module) -> int:
    """Bytes of the int4 copies (codes, scales and zeros) in ``model``'s tree."""
    return sum(
        m._packed.numel() * m._packed.element_size() + m._scale_zero.numel() * m._scale_zero.element_size()
        for m in model.modules()
        if isinstance(m, Int4Linear)
    )
