"""LoRA memories: ``W x + (alpha / r) * B A x`` on the attention and MLP projections, as forward hooks.

The paper's LoRA ablation uses rank 16 on all attention and MLP projections (q, k, v, o, gate, up,
down) and lr 1e-4. Here the delta is a *forward hook* on each target ``nn.Linear``, installed by
:meth:`LoraAdapter.apply` and removed when its ``with`` block ends, instead of PEFT's module
replacement: the one frozen model is shared by the backend, the key builders, the verifiers and the
trainer (and other threads may use it meanwhile), so a memory must condition only the forwards it
was applied to, in the thread that applied it, and never change a weight. Gradients reach A and B
through the hook's output; the base weights have ``requires_grad=False`` and are never written.

``B`` starts at zero (standard LoRA; PEFT's default), so an untrained memory *is* the base model:
the KL reference of GRPO (the initial memory) needs no adapter at all. ``A`` starts as PEFT's
``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(fan_in), from the training seed.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError
from elm_memory.memory.kinds import LORA, LORA_ROWS, AppliedMemory, digest_tensors

#: The paper's targets: every attention and MLP projection of a Llama/Qwen decoder layer.
TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"lora\.([A-Za-z0-9_.]{1,200})\.(A|B)")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def target_linears(model: Any, targets: Sequence[str] = TARGET_MODULES) -> dict[str, torch.nn.Linear]:
    """The model's ``nn.Linear`` modules whose last name is in ``targets``, by their full module path
    (``model.layers.0.self_attn.q_proj``: the path PEFT's state dict uses too)."""
    wanted = set(targets)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
    }


class LoraAdapter:
    """A LoRA memory: per target module ``A`` (r x in) and ``B`` (out x r), float32, scaled by alpha / r."""

    kind = LORA

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float):
        if not weights:
            raise MemoryFormatError("a lora memory needs at least one target module")
        ranks = {int(a.shape[0]) for a, _ in weights.values()}
        if len(ranks) != 1:
            raise MemoryFormatError(f"lora memory mixes ranks {sorted(ranks)}")
        self.weights = weights
        self.rank = ranks.pop()
        self.alpha = float(alpha)
        self._own_tensors = False  # see detached()
        self._digest: str | None = None
        for name, (a, b) in weights.items():
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != self.rank:
                raise MemoryFormatError(
                    f"lora {name}: A must be (r, in) and B (out, r), got {tuple(a.shape)} and {tuple(b.shape)}"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise MemoryFormatError(f"lora {name} contains NaN or inf")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise MemoryFormatError(f"lora alpha must be a positive number, got {alpha!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_modules(self) -> list[str]:
        """The short names targeted (``q_proj``...), as PEFT's ``target_modules``."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.weights})

    # -- construction ----------------------------------------------------------------
    @classmethod
    def initial(
        cls, model: Any, *, rank: int, alpha: float, targets: Sequence[str] = TARGET_MODULES, seed: int | None = None
    ) -> LoraAdapter:
        """A fresh memory for ``model``: B = 0 (the base model exactly), A kaiming-uniform from ``seed``."""
        modules = target_linears(model, targets)
        if not modules:
            raise IncompatibleMemoryError(f"the model has none of the lora target modules {', '.join(targets)}")
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        weights = {}
        for name, lin in modules.items():
            bound = 1.0 / math.sqrt(lin.in_features)
            a = (torch.rand(rank, lin.in_features, generator=gen) * 2 - 1) * bound
            weights[name] = (a, torch.zeros(lin.out_features, rank))
        return cls(weights, alpha)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], alpha: float) -> LoraAdapter:
        """From stored tensors ``lora.<module>.A`` / ``.B`` (every name must be one of a pair)."""
        return cls(_pairs({k: t.detach().to("cpu", torch.float32) for k, t in tensors.items()}), alpha)

    @classmethod
    def over(cls, tensors: dict[str, torch.Tensor], alpha: float) -> LoraAdapter:
        """A LoRA over these very tensors (named as :meth:`tensors` names them), not copies: gradients reach them
        through its hooks (what a trainer that owns the tensors needs)."""
        return cls(_pairs(tensors), alpha)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in sorted(self.weights):
            a, b = self.weights[name]
            out[f"lora.{name}.A"], out[f"lora.{name}.B"] = a, b
        return out

    def parameters(self) -> list[torch.Tensor]:
        return [t for ab in self.weights.values() for t in ab]

    def trainable(self) -> LoraAdapter:
        """A copy whose tensors are leaf ``nn.Parameter`` s (what the trainer's AdamW updates)."""
        return LoraAdapter(
            {
                n: (torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone()))
                for n, (a, b) in self.weights.items()
            },
            self.alpha,
        )

    def detached(self) -> LoraAdapter:
        """A copy with tensors of its own, which nothing changes in place: its digest is computed once."""
        copy = LoraAdapter(
            {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in self.weights.items()}, self.alpha
        )
        copy._own_tensors = True
        return copy

    def digest(self) -> str:
        if self._digest is not None:
            return self._digest
        digest = digest_tensors(self.tensors()) + f"/alpha={self.alpha}"
        if self._own_tensors:
            self._digest = digest
        return digest

    def max_layer(self) -> int:
        """The highest decoder-layer index a module path names (-1 if none does)."""
        found = [int(m.group(1)) for name in self.weights if (m := _LAYER.search(f".{name}."))]
        return max(found, default=-1)

    # -- use -------------------------------------------------------------------------
    def check_model(self, model: Any) -> dict[str, torch.nn.Linear]:
        """The model's modules for each of the memory's, or :class:`IncompatibleMemoryError`."""
        modules = dict(model.named_modules())
        out = {}
        for name, (a, b) in self.weights.items():
            lin = modules.get(name)
            if not isinstance(lin, torch.nn.Linear):
                raise IncompatibleMemoryError(f"lora memory targets {name}, which this model does not have")
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise IncompatibleMemoryError(
                    f"lora {name} is {tuple(b.shape[:1])}x{tuple(a.shape[1:])}; the model's module is "
                    f"{lin.out_features}x{lin.in_features}"
                )
            out[name] = lin
        return out

    @contextmanager
    def apply(self, model: Any, batch_size: int) -> Iterator[AppliedMemory]:
        """Hooks on every target module for the ``with`` block, always removed; nothing else changes."""
        modules = self.check_model(model)
        scale = self.scale
        handles = []
        # hooks are seen by every thread using the shared model (a background learner trains while the
        # graph answers): only the thread that applied the memory gets its delta
        owner = threading.get_ident()

        def make_hook(a: torch.Tensor, b: torch.Tensor) -> Any:
            def hook(_module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
                if threading.get_ident() != owner:
                    return output
                x = args[0]
                # in the model's dtype (as the base product): an fp32 delta on a bf16 model would cost a cast
                # of every activation; gradients still reach the fp32 A and B through .to()
                delta = F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
                return output + delta * scale

            return hook

        try:
            for name, lin in modules.items():
                a, b = self.weights[name]
                # cast once where nothing needs a gradient (decoding): not per forward, per module
                frozen = not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
                dtype = lin.weight.dtype if frozen else None
                handles.append(
                    lin.register_forward_hook(make_hook(a.to(lin.weight.device, dtype), b.to(lin.weight.device, dtype)))
                )
            yield AppliedMemory()
        finally:
            for h in handles:
                h.remove()


class RowLoras:
    """Prompts of different LoRA memories (or none) in one batch: prompt i's rows get ``adapters[i]``'s delta,
    a ``None`` prompt the base model. What a backend applies to decode a stream memory's rows beside the base
    model's in one batch (a plain :class:`LoraAdapter` conditions every row). Decoding only: no gradients.

    One hook per target module adds each adapter's delta to its own rows (``index_add`` over the rows it
    holds); the decode loop reports every reordering of the batch (:meth:`AppliedMemory.select_rows`), so the
    rows follow their prompts through repetition (n samples of a prompt) and dropped finished rows."""

    kind = LORA_ROWS

    def __init__(self, adapters: Sequence[LoraAdapter | None]):
        self.adapters = list(adapters)
        self.distinct = list({id(a): a for a in self.adapters if a is not None}.values())
        if not self.distinct:
            raise ValueError("RowLoras needs at least one lora memory")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{j}.{k}": t for j, a in enumerate(self.distinct) for k, t in a.tensors().items()}

    def parameters(self) -> list[torch.Tensor]:
        return [t for a in self.distinct for t in a.parameters()]

    def detached(self) -> RowLoras:
        copies = {id(a): a.detached() for a in self.distinct}
        return RowLoras([None if a is None else copies[id(a)] for a in self.adapters])

    def digest(self) -> str:
        return "rows:" + ",".join("-" if a is None else a.digest() for a in self.adapters)

    @contextmanager
    def apply(self, model: Any, batch_size: int) -> Iterator[AppliedMemory]:
        """Hooks for the ``with`` block (always removed); starts with one batch row per prompt."""
        owner = threading.get_ident()
        device = next(model.parameters()).device  # row indices live there: no copy per hook call
        which = torch.tensor(
            [-1 if a is None else next(j for j, d in enumerate(self.distinct) if d is a) for a in self.adapters],
            device=device,
        )
        rows: list[torch.Tensor] = []

        def follow(index: torch.Tensor) -> None:
            nonlocal which
            which = which[index.to(which.device)]
            rows[:] = [torch.nonzero(which == j).flatten() for j in range(len(self.distinct))]

        follow(torch.arange(len(self.adapters), device=device))
        per_module: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        linears: dict[str, torch.nn.Linear] = {}
        for j, adapter in enumerate(self.distinct):
            for name, lin in adapter.check_model(model).items():
                a, b = adapter.weights[name]
                linears[name] = lin
                w = lin.weight
                per_module.setdefault(name, []).append(
                    (j, a.detach().to(w.device, w.dtype), b.detach().to(w.device, w.dtype), adapter.scale)
                )

        def make_hook(deltas: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> Any:
            def hook(_module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
                if threading.get_ident() != owner:
                    return output
                x = args[0]
                for j, a, b, scale in deltas:
                    idx = rows[j]
                    if idx.numel():
                        delta = F.linear(F.linear(x.index_select(0, idx), a), b) * scale
                        output = output.index_add(0, idx, delta.to(output.dtype))
                return output

            return hook

        handles = [linears[name].register_forward_hook(make_hook(d)) for name, d in per_module.items()]
        try:
            yield AppliedMemory(on_rows=follow)
        finally:
            for h in handles:
                h.remove()


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Tensors named ``lora.<module>.A`` / ``.B`` as (A, B) per module; any other name, or half a pair, is refused."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        match = _NAME.fullmatch(key)
        if match is None:
            raise MemoryFormatError(f"unexpected tensor {key[:80]!r} in a lora memory")
        pairs.setdefault(match.group(1), {})[match.group(2)] = t
    missing = [name for name, ab in pairs.items() if set(ab) != {"A", "B"}]
    if missing:
        raise MemoryFormatError(f"lora module {missing[0][:80]!r} lacks its A or B tensor")
    return {name: (ab["A"], ab["B"]) for name, ab in pairs.items()}
