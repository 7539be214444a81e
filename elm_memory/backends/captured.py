"""Captured decode steps: a static KV cache and one CUDA graph per shape bucket.

A 0.5B model's decode step is a few hundred small kernels. The plain loop
(:mod:`elm_memory.backends.decode`) issues them one by one from Python, so on a GPU a step costs
what the host takes to launch them, far above what the GPU takes to run them. Here the step runs
on a static KV cache (``transformers.StaticCache``: fixed shapes, fixed addresses) through
``torch.compile`` (fused kernels), and on CUDA ``read_every`` steps -- the forwards, the token
choices and the bookkeeping between them -- are captured as **one CUDA graph**: the host launches
one graph per ``read_every`` tokens and reads the tokens back, and nothing else runs on the host
between steps (no guards, no input copies, no per-step launches). On a CPU the same steps run
without a graph (inductor kernels when compiled).

What stays the plain loop's: the prefill (soft prompts, a prefix memory's cache, one prefill per
prompt shared by its rows), the token choice (:func:`sampling.pick_tokens` with the same per-row keys
and token indices, so the same tokens), stop-at-answer and EOS. What changes:

- **The token is chosen on the device.** Each row's draw is a hash of its key and the token's
  index, so the next token is picked from the step's logits on the device and fed to the next step;
  the host reads the tokens back every ``read_every`` steps (8 on a GPU), and a row that ended
  inside those steps keeps only its tokens up to its end (the steps after it were computed and
  dropped: its tokens do not depend on them).
- **Slots.** Everything a step reads or writes (the cache, the fed tokens, positions, mask, draw
  counters, the tokens picked) lives in tensors made once per bucket, updated in place, so a
  captured graph replays on whatever call filled them.
- **Buckets.** Slots and graphs exist per (batch rows, cache length) pair. Rows are padded up to
  a power of two (at most ``max_rows``) and the cache length up to a power of two of at least 256
  tokens, so a stream compiles a handful of shapes per process, not one per call. A call that fits
  no bucket (longer than ``max_cache_len``) is decoded by the plain loop, with one log line.
- **Finished rows stay in place, masked**, instead of leaving the batch (a shape change would mean
  another graph); once the live rows fit a bucket a quarter of the size, they move to it.
- **One call at a time** owns the slots; a call from another thread meanwhile takes the plain loop.
- **The attention mask is built here**, one boolean row per sequence over the whole cache, and
  given to the model ready-made, so no mask logic runs inside the compiled step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from elm_memory.backends import packed_attention
from elm_memory.backends.sampling import RowChoice, pick_tokens, uniforms

if TYPE_CHECKING:
    from elm_memory.backends.decode import DecodeOptions

log = logging.getLogger(__name__)

MIN_CACHE_LEN = 256
SHRINK_FACTOR = 4  # move live rows to a smaller bucket once they fit one this many times smaller


def _bucket(n: int, smallest: int = 1) -> int:
    size = smallest
    while size < n:
        size *= 2
    return size


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model cannot take captured steps (None: it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (captured steps build masks for sdpa and eager)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"]):
        return "the model has sliding-window layers"
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:  # pragma: no cover - transformers without a static cache
        return "this transformers version has no StaticCache"
    if not hasattr(StaticLayer, "lazy_initialization"):
        return "this transformers version's StaticLayer has no lazy_initialization"
    del StaticCache
    return None


@dataclass
class _Slots:
    """A bucket's static tensors: the KV cache and every value a decode step reads or writes."""

    cache: Any
    ids: torch.Tensor  # [rows, 1] the token each row feeds next
    next_pos: torch.Tensor  # [rows, 1] its position id
    attend: torch.Tensor  # [rows, 1, 1, length] which cache positions each row attends to
    written: torch.Tensor  # [1] the cache position the next step writes
    counts: torch.Tensor  # [rows] the index of the token each row picks next (its draw's counter)
    temperature: torch.Tensor
    top_p: torch.Tensor
    keys: torch.Tensor
    history: torch.Tensor  # [rows, read_every] the tokens picked since the host last read them
    graphs: dict[tuple[bool, bool, bool], Any] = field(default_factory=dict)  # per kind of token choice

    @property
    def rows(self) -> int:
        return self.ids.shape[0]


class CapturedSteps:
    """Decode steps for one model on static caches, compiled once per shape bucket.

    ``compile``: run the step's forward through ``torch.compile`` (inductor kernels), and on CUDA
    capture ``read_every`` steps as one CUDA graph. Without it the steps run eagerly on the same
    slots, buckets and masks: what the tests compare against the plain loop on any machine.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compile: bool,
        max_rows: int,
        max_cache_len: int,
        read_every: int | None = None,
        pack_query_heads: bool = True,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"captured decode steps cannot run this model: {reason}")
        if read_every is not None and read_every < 1:
            raise ValueError(f"read_every must be at least 1, got {read_every}")
        self.model = model
        self.max_rows = _bucket(max_rows)
        self.max_cache_len = max_cache_len
        self.compiled = compile
        self.on_gpu = next(model.parameters()).device.type == "cuda"
        # on a GPU one graph runs read_every steps and the host waits only for its tokens; on a CPU nothing
        # runs ahead, and reading every step wastes no steps past a row's end
        self.read_every = read_every if read_every is not None else (8 if self.on_gpu else 1)
        self.graphs = compile and self.on_gpu
        self._graph_failure: str | None = None  # why capturing failed once (then the steps run without graphs)
        self._pool: Any = None
        self._additive = model.config._attn_implementation == "eager"  # type: ignore[union-attr]
        # steps read each key/value head once (packed_attention); False keeps transformers' copies
        self.pack_query_heads = pack_query_heads
        if self.pack_query_heads:
            packed_attention.install()
        self._slots: dict[tuple[int, int], _Slots] = {}
        self._logged: set[str] = set()
        # one decode at a time owns the slots; a call from another thread meanwhile (a background learner
        # beside the answer path) takes the plain loop instead of waiting or sharing a cache
        self._busy = threading.Lock()
        self.buckets_seen: list[tuple[int, int]] = []  # (rows, cache length) of each bucket met, in order
        self._step: Callable[..., torch.Tensor] = self._forward
        self._draws: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = uniforms
        if compile:
            import torch._dynamo

            # one compiled forward per bucket: allow every bucket this runner can meet
            buckets = (self.max_rows.bit_length()) * (max(1, (max_cache_len // MIN_CACHE_LEN)).bit_length() + 1)
            limit = max(int(getattr(torch._dynamo.config, "recompile_limit", 8)), buckets + 8)
            torch._dynamo.config.recompile_limit = limit
            # no compiler-made CUDA graphs: the graph captured here holds the whole step, token choice included
            self._step = torch.compile(self._forward, fullgraph=True, dynamic=False)
            # the draws' hash is a few dozen integer operations: one fused kernel, bit for bit the same
            self._draws = torch.compile(uniforms, fullgraph=True, dynamic=False)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step: the last position's logits of every row."""
        if self._additive:  # the eager attention adds its mask; sdpa takes the boolean one as it is
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,  # 4D: transformers takes a ready mask as it is
            past_key_values=cache,
            use_cache=True,
            **(packed_attention.REQUEST if self.pack_query_heads else {}),
        )
        return out.logits[:, -1, :]

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.info(message)

    def _slots_for(self, rows: int, length: int, like: Any, device: torch.device) -> _Slots:
        """The slots of a bucket, made once (their addresses are what a captured graph reads)."""
        from transformers import StaticCache

        key = (rows, length)
        slots = self._slots.get(key)
        if slots is None:
            cache: Any = StaticCache(config=cast(Any, self.model).config, max_cache_len=length)
            for static, dynamic in zip(cache.layers, like.layers, strict=True):
                k, v = dynamic.keys, dynamic.values
                static.lazy_initialization(
                    k.new_zeros(rows, k.shape[1], 1, k.shape[3]), v.new_zeros(rows, v.shape[1], 1, v.shape[3])
                )

            def longs(*shape: int) -> torch.Tensor:
                return torch.zeros(*shape, dtype=torch.long, device=device)

            def floats() -> torch.Tensor:
                return torch.ones(rows, dtype=torch.float32, device=device)

            slots = _Slots(
                cache=cache,
                ids=longs(rows, 1),
                next_pos=longs(rows, 1),
                attend=torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device),
                written=longs(1),
                counts=longs(rows),
                temperature=floats(),
                top_p=floats(),
                keys=longs(rows),
                history=longs(rows, self.read_every),
            )
            self._slots[key] = slots
            self.buckets_seen.append(key)
            if self.compiled:
                self._log_once(f"captured decode: compiling the step for {rows} rows x {length} cache positions")
        return slots

    @staticmethod
    def _fill(cache: Any, source: Any, rows: torch.Tensor | None, length: int) -> None:
        """Copy the first ``length`` positions of ``source``'s layers (rows ``rows``, all if None) into ``cache``."""
        for static, layer in zip(cache.layers, source.layers, strict=True):
            k = layer.keys if rows is None else layer.keys.index_select(0, rows)
            v = layer.values if rows is None else layer.values.index_select(0, rows)
            static.keys[: k.shape[0], :, :length].copy_(k[:, :, :length])
            static.values[: v.shape[0], :, :length].copy_(v[:, :, :length])
            static.cumulative_length.fill_(length)

    def _advance(self, s: _Slots, flags: dict[str, bool]) -> None:
        """``read_every`` decode steps on a bucket's slots, all in place (what a graph captures): each
        step marks the position it writes as attended, runs the forward, picks every row's token and
        feeds it to the next step."""
        for i in range(self.read_every):
            s.attend.index_fill_(3, s.written, True)
            logits = self._step(s.ids, s.next_pos, s.attend, s.cache)
            picked = pick_tokens(logits, s.temperature, s.top_p, s.keys, s.counts, draws=self._draws, **flags)
            s.history[:, i].copy_(picked)
            s.ids[:, 0].copy_(picked)
            s.next_pos.add_(1)
            s.written.add_(1)
            s.counts.add_(1)

    def _graph(self, s: _Slots, flags: dict[str, bool]) -> Any:
        """The CUDA graph of ``_advance`` on these slots for this kind of choice, captured on first use
        (None once capturing has failed: the steps then run without graphs). Capture comes before the
        call fills the slots: the warm-up runs write into them."""
        if not self.graphs or self._graph_failure is not None:
            return None
        kind = (flags["any_sampled"], flags["any_nucleus"], flags["any_greedy"])
        graph = s.graphs.get(kind)
        if graph is not None:
            return graph
        try:
            s.written.zero_()  # warm-up steps write from position 0 of the cache, never past its end
            for layer in s.cache.layers:
                layer.cumulative_length.zero_()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile the forward, set up cuBLAS and the allocator off the capture
                self._advance(s, flags)
                self._advance(s, flags)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a learner thread's CUDA work meanwhile does not break the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._advance(s, flags)
        except Exception as error:  # a capture that fails leaves correct, slower steps: say so once
            self._graph_failure = f"{type(error).__name__}: {error}"
            log.warning("captured decode: capturing a CUDA graph failed (%s); decoding without graphs", error)
            return None
        s.graphs[kind] = graph
        return graph

    def _run(self, s: _Slots, flags: dict[str, bool], graph: Any) -> list[list[int]]:
        """``read_every`` steps; the tokens they picked, per bucket row."""
        if graph is not None:
            graph.replay()
        else:
            self._advance(s, flags)
        return cast(list[list[int]], s.history.tolist())

    def decode(
        self,
        prefilled: Any,
        logits: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        row_prompt: list[int],
        per_prompt: list[DecodeOptions],
        eos: torch.Tensor,
        choice: RowChoice,
        should_stop: Callable[[int, list[int], int], bool] | None,
    ) -> list[tuple[list[int], str]] | None:
        """The decode loop after a prefill (``prefilled``: its dynamic cache, one row per output row;
        ``logits``: the prefill's last-position logits; ``mask`` (rows, T0) and ``positions`` as the
        plain loop holds them; ``choice``: the rows' temperatures, top-p and draw keys). None when no
        bucket fits or another call holds the slots: the caller decodes with the plain loop."""
        if not self._busy.acquire(blocking=False):
            self._log_once("captured decode: busy with another call; decoding this one with the plain loop")
            return None
        try:
            return self._decode(prefilled, logits, mask, positions, row_prompt, per_prompt, eos, choice, should_stop)
        finally:
            self._busy.release()

    def _decode(
        self,
        prefilled: Any,
        logits: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        row_prompt: list[int],
        per_prompt: list[DecodeOptions],
        eos: torch.Tensor,
        choice: RowChoice,
        should_stop: Callable[[int, list[int], int], bool] | None,
    ) -> list[tuple[list[int], str]] | None:
        from elm_memory.backends.decode import _append

        rows, prompt_len = mask.shape
        limit = [per_prompt[p].max_new_tokens for p in row_prompt]
        steps = max(limit)
        if steps < 1:  # nothing to decode: the plain loop returns the empty rows
            return None
        # the last read may run up to read_every - 1 steps past the longest row: room for them in the cache
        length = _bucket(prompt_len + steps + self.read_every, MIN_CACHE_LEN)
        if rows > self.max_rows or length > self.max_cache_len:
            self._log_once(
                f"captured decode: {rows} rows x {prompt_len + steps} positions fit no bucket "
                f"(at most {self.max_rows} rows x {self.max_cache_len}); decoding this call with the plain loop"
            )
            return None
        device = logits.device
        flags = choice.flags
        # padding rows take the kind of choice the real rows take (no argmax pass just for them); their
        # tokens are never read
        pad_temperature = 0.0 if choice.any_greedy else 1.0

        def enter(
            width: int,
            source: Any,
            select: torch.Tensor | None,
            written: int,
            made: int,
            attend: torch.Tensor,
            next_pos: torch.Tensor,
            ids: torch.Tensor,
            temperature: torch.Tensor,
            top_p: torch.Tensor,
            keys: torch.Tensor,
        ) -> tuple[_Slots, Any]:
            """The bucket of ``width`` rows and its graph, captured before anything is filled (the capture's
            warm-up writes into the slots); then the cache's first ``written`` positions from ``source``
            (rows ``select``, all if None), the live rows' values with padding after them, and the counters."""
            s = self._slots_for(width, length, prefilled, device)
            graph = self._graph(s, flags)
            self._fill(s.cache, source, select, written)
            n = ids.shape[0]
            s.attend.zero_()
            s.attend[:n].copy_(attend)
            s.attend[n:, 0, 0, 0] = True  # padding rows attend to one position: no row is all masked
            for slot, value, pad in (
                (s.next_pos, next_pos, 0),
                (s.ids, ids, 0),
                (s.temperature, temperature, pad_temperature),
                (s.top_p, top_p, 1.0),
                (s.keys, keys, 0),
            ):
                slot[:n].copy_(value)
                slot[n:].fill_(pad)
            s.written.fill_(written)
            s.counts.fill_(made)
            return s, graph

        first = choice.pick(logits, choice.temperature, choice.top_p, choice.keys, torch.zeros_like(choice.keys))
        eos_set = set(eos.tolist())
        options = per_prompt[0]
        tokens: list[list[int]] = [[] for _ in range(rows)]
        reasons = ["length"] * rows
        alive = [_append(r, tok, tokens, reasons, limit, eos_set, should_stop) for r, tok in enumerate(first.tolist())]
        if not any(alive):
            return list(zip(tokens, reasons, strict=True))

        prompt_attend = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device)
        prompt_attend[:, 0, 0, :prompt_len] = mask.bool()
        s, graph = enter(
            _bucket(rows),
            prefilled,
            None,
            prompt_len,
            1,
            prompt_attend,
            positions[:, -1:] + 1,
            first.unsqueeze(1),
            choice.temperature,
            choice.top_p,
            choice.keys,
        )
        live = list(range(rows))  # the output row at each batch position (padding rows excluded)
        written, made = prompt_len, 1  # cache positions written; tokens every row has been given
        while True:
            picked = self._run(s, flags, graph)
            written += self.read_every
            made += self.read_every
            for b, got in enumerate(picked[: len(live)]):
                for tok in got:  # a row that ended inside these steps keeps its tokens up to its end
                    if not alive[b]:
                        break
                    alive[b] = _append(live[b], tok, tokens, reasons, limit, eos_set, should_stop)
            if made >= steps or not any(alive):
                break
            smaller = _bucket(sum(alive))
            if options.drop_finished and smaller * SHRINK_FACTOR <= s.rows:  # move the live rows to a smaller bucket
                keep = torch.tensor([b for b, a in enumerate(alive) if a], device=device)
                old = s
                kept = (old.attend, old.next_pos, old.ids, old.temperature, old.top_p, old.keys)
                s, graph = enter(smaller, old.cache, keep, written, made, *(t.index_select(0, keep) for t in kept))
                live, alive = [live[b] for b in keep.tolist()], [True] * len(keep)
        return list(zip(tokens, reasons, strict=True))
