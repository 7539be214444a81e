"""Frozen linear weights kept in oneDNN's own layout on CPUs (``model.cpu_weight_prepack``).

Why: for every bf16 ``F.linear`` on a CPU, oneDNN first copies the weight into the blocked layout its
AMX / AVX512-BF16 kernels read. A decode step is bound by reading the weights, so that copy costs
about a quarter of the step (docs/performance.md). The base model is frozen, so each weight is
reordered once, after loading, and every forward reads the reordered copy. The product is the same
up to rounding: at most row counts oneDNN runs the same kernel either way, at some it blocks the sum
differently (bf16 results then differ in the last bit, as they do between batch sizes already).

The price is a second copy of the linear weights in memory (about 1.3 GB for the 0.5B model in bf16).
Forwards that build a graph (soft-prompt training) use ``F.linear``: with thousands of rows the products
are bound by arithmetic, and a packed training step measured no faster.

Weights are reordered once: a model whose linear weights are changed afterwards (merging an adapter
into them, say) must be loaded with ``model.cpu_weight_prepack: off``. A forward that finds its weight
replaced, or that runs on another device, under ``torch.compile`` or with a trainable weight, uses
``F.linear`` too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: The batch size oneDNN is told to expect. On an AMX Xeon, 8 to 128 all matched F.linear's results
#: at the same row counts (all but a few between 76 and 96, and 512); 16 also differed at one row.
BATCH_HINT = 64


@functools.lru_cache(maxsize=4)
def prepack_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear ops in ``dtype``."""
    ops = torch.ops.mkldnn
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if not all(callable(getattr(ops, name, None)) for name in ("_reorder_linear_weight", "_linear_pointwise")):
            return False
        if dtype == torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        return dtype == torch.float32
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen weight also lives in oneDNN's layout (see the module docstring).

    Made by changing the class of a loaded ``nn.Linear`` in place, so hooks (LoRA memories), PEFT
    wrappers and ``isinstance`` checks see the module they saw before."""

    _packed: torch.Tensor
    _packed_from: int  # the weight's data_ptr when it was packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            torch.compiler.is_compiling()  # first: the compiler cannot trace the data_ptr comparison below
            or x.device.type != "cpu"
            or x.dtype != weight.dtype
            or weight.requires_grad
            or (x.requires_grad and torch.is_grad_enabled())
            or weight.data_ptr() != self._packed_from
        ):
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the opaque packed tensor behind and run ``F.linear``."""
        state = {k: v for k, v in self.__dict__.items() if k != "_packed"}
        state["_packed_from"] = -1
        return state


def prepack_linears(model: torch.nn.Module) -> int:
    """Reorder every frozen ``nn.Linear`` weight of ``model`` (on a CPU) into oneDNN's layout; returns how many.

    Only plain ``nn.Linear`` modules with a frozen bf16 or float32 weight are changed; call it after the
    model is on its device and frozen."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not torch.nn.Linear:
                continue
            weight = module.weight
            if weight.device.type != "cpu" or weight.requires_grad or not prepack_available(weight.dtype):
                continue
            module.__class__ = PackedLinear
            packed_module = cast(PackedLinear, module)
            packed_module._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
            packed_module._packed_from = weight.data_ptr()
            count += 1
    logger.debug("prepacked %d linear weights", count)
    return count


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo :func:`prepack_linears` (frees the packed copies); returns how many modules it changed."""
    count = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            del module._packed, module._packed_from
            plain: torch.nn.Module = module
            plain.__class__ = torch.nn.Linear
            count += 1
    return count
