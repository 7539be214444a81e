"""Captured decode steps: a static KV cache and one compiled step per shape bucket.

A 0.5B model's decode step is a few hundred small kernels. The plain loop
(:mod:`elm_memory.backends.decode`) issues them one by one from Python, so on a GPU a step costs
what the host takes to launch them, far above what the GPU takes to run them. Here the step runs
on a static KV cache (``transformers.StaticCache``: fixed shapes, fixed addresses) through
``torch.compile``; on CUDA with ``mode="reduce-overhead"``, so each step replays a captured CUDA
graph. On a CPU the same compiled step only fuses kernels (no graphs).

What stays the plain loop's: the prefill (soft prompts, a prefix memory's cache, one prefill per
prompt shared by its rows), the token choice (:func:`sampling.pick_tokens` with the same per-row keys
and token indices, so the same tokens), stop-at-answer and EOS. What changes:

- **The token is chosen on the device.** Each row's draw is a hash of its key and the token's
  index, so the next token is picked from the step's logits on the device and fed to the next step
  with no host round trip; the host reads the tokens back every ``read_every`` steps (8 on a GPU)
  instead of every step, and a row that ended inside those steps keeps only its tokens up to its end
  (the steps after it were computed and dropped: its tokens do not depend on them).
- **Buckets.** A compiled step exists per (batch rows, cache length) pair. Rows are padded up to
  a power of two (at most ``max_rows``) and the cache length up to a power of two of at least 256
  tokens, so a stream compiles a handful of shapes per process, not one per call. A call that fits
  no bucket (longer than ``max_cache_len``) is decoded by the plain loop, with one log line.
- **Finished rows stay in place, masked**, instead of leaving the batch (a shape change would mean
  another compiled step); once the live rows fit a bucket a quarter of the size, they move to it.
- **One call at a time** owns the static caches; a call from another thread meanwhile takes the plain
  loop.
- **The attention mask is built here**, one boolean row per sequence over the whole cache, and
  given to the model ready-made, so no mask logic runs inside the compiled step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from elm_memory.backends.sampling import RowChoice, pick_tokens

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


class CapturedSteps:
    """Decode steps for one model on static caches, compiled once per shape bucket.

    ``compile``: run the step through ``torch.compile`` (``reduce-overhead``: CUDA graphs on a GPU;
    inductor kernels on a CPU). Without it the step runs eagerly on the same static cache, the
    same buckets and masks: what the tests compare against the plain loop on any machine.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compile: bool,
        max_rows: int,
        max_cache_len: int,
        read_every: int | None = None,
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
        on_gpu = next(model.parameters()).device.type == "cuda"
        # on a GPU the host queues steps ahead of the device unless it waits for each step's tokens; on a
        # CPU nothing runs ahead, and reading every step wastes no steps past a row's end
        self.read_every = read_every if read_every is not None else (8 if on_gpu else 1)
        self._additive = model.config._attn_implementation == "eager"  # type: ignore[union-attr]
        self._caches: dict[tuple[int, int], Any] = {}
        self._logged: set[str] = set()
        # one decode at a time owns the static caches; a call from another thread meanwhile (a background
        # learner beside the answer path) takes the plain loop instead of waiting or sharing a cache
        self._busy = threading.Lock()
        self.buckets_seen: list[tuple[int, int]] = []  # (rows, cache length) of each bucket met, in order
        self._step: Callable[..., torch.Tensor] = self._forward
        if compile:
            import torch._dynamo

            # one compiled step per bucket: allow every bucket this runner can meet
            buckets = (self.max_rows.bit_length()) * (max(1, (max_cache_len // MIN_CACHE_LEN)).bit_length() + 1)
            limit = max(int(getattr(torch._dynamo.config, "recompile_limit", 8)), buckets + 8)
            torch._dynamo.config.recompile_limit = limit
            self._step = torch.compile(
                self._forward, mode="reduce-overhead" if on_gpu else None, fullgraph=True, dynamic=False
            )

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
        )
        return out.logits[:, -1, :]

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.info(message)

    def _cache(self, rows: int, length: int, like: Any) -> Any:
        """The static cache of a bucket, made once (its tensors' addresses are what a captured graph reads)."""
        from transformers import StaticCache

        key = (rows, length)
        cache = self._caches.get(key)
        if cache is None:
            made: Any = StaticCache(config=cast(Any, self.model).config, max_cache_len=length)
            for static, dynamic in zip(made.layers, like.layers, strict=True):
                k, v = dynamic.keys, dynamic.values
                static.lazy_initialization(
                    k.new_zeros(rows, k.shape[1], 1, k.shape[3]), v.new_zeros(rows, v.shape[1], 1, v.shape[3])
                )
            self._caches[key] = cache = made
            self.buckets_seen.append(key)
            if self.compiled:
                self._log_once(f"captured decode: compiling the step for {rows} rows x {length} cache positions")
        return cache

    @staticmethod
    def _fill(cache: Any, source: Any, rows: torch.Tensor | None, length: int) -> None:
        """Copy the first ``length`` positions of ``source``'s layers (rows ``rows``, all if None) into ``cache``."""
        for static, layer in zip(cache.layers, source.layers, strict=True):
            k = layer.keys if rows is None else layer.keys.index_select(0, rows)
            v = layer.values if rows is None else layer.values.index_select(0, rows)
            static.keys[: k.shape[0], :, :length].copy_(k[:, :, :length])
            static.values[: v.shape[0], :, :length].copy_(v[:, :, :length])
            static.cumulative_length.fill_(length)

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
        bucket fits or another call holds the caches: the caller decodes with the plain loop."""
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
        length = _bucket(prompt_len + steps, MIN_CACHE_LEN)
        if rows > self.max_rows or length > self.max_cache_len:
            self._log_once(
                f"captured decode: {rows} rows x {prompt_len + steps} positions fit no bucket "
                f"(at most {self.max_rows} rows x {self.max_cache_len}); decoding this call with the plain loop"
            )
            return None
        device = logits.device
        width = _bucket(rows)
        cache = self._cache(width, length, prefilled)
        self._fill(cache, prefilled, None, prompt_len)

        def padded(t: torch.Tensor, fill: float | int | bool, rows_now: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((width - rows_now, *t.shape[1:]), fill)]) if width > rows_now else t

        attend = torch.zeros(width, 1, 1, length, dtype=torch.bool, device=device)
        attend[:rows, 0, 0, :prompt_len] = mask.bool()
        attend[rows:, 0, 0, 0] = True  # padding rows attend to one position: no row is all masked
        next_pos = padded(positions[:, -1:] + 1, 0, rows)
        # padding rows take the kind of choice the real rows take (no argmax pass just for them); their
        # tokens are never read
        pad_temperature = 0.0 if choice.any_greedy else 1.0
        temperature = padded(choice.temperature, pad_temperature, rows)
        top_p = padded(choice.top_p, 1.0, rows)
        keys = padded(choice.keys, 0, rows)
        counts = torch.zeros(width, dtype=torch.long, device=device)  # the index of the token each row picks next
        flags = choice.flags
        history = torch.zeros(width, self.read_every, dtype=torch.long, device=device)
        ids = padded(choice.pick(logits, choice.temperature, choice.top_p, choice.keys, counts[:rows]), 0, rows)
        ids = ids.unsqueeze(1)
        history[:, 0] = ids[:, 0]

        eos_set = set(eos.tolist())
        options = per_prompt[0]
        tokens: list[list[int]] = [[] for _ in range(rows)]
        reasons = ["length"] * rows
        live = list(range(rows))  # the output row at each batch position (padding rows excluded)
        alive = [True] * rows
        written = prompt_len  # cache positions written so far (the next step writes here)
        held, made = 1, 1  # tokens in ``history`` not read yet; tokens every row has been given
        while True:
            if held == self.read_every or made == steps:
                for b, got in enumerate(history[: len(live), :held].tolist()):
                    for tok in got:  # a row that ended inside these steps keeps its tokens up to its end
                        if not alive[b]:
                            break
                        alive[b] = _append(live[b], tok, tokens, reasons, limit, eos_set, should_stop)
                held = 0
                if made == steps or not any(alive):
                    break
                smaller = _bucket(sum(alive))
                if options.drop_finished and smaller * SHRINK_FACTOR <= width:  # move the live rows to a smaller bucket
                    keep = torch.tensor([b for b, a in enumerate(alive) if a], device=device)
                    old = cache
                    cache = self._cache(smaller, length, prefilled)
                    self._fill(cache, old, keep, written)
                    width, kept = smaller, len(keep)
                    attend = padded(attend.index_select(0, keep), False, kept)
                    attend[kept:, 0, 0, 0] = True
                    next_pos = padded(next_pos.index_select(0, keep), 0, kept)
                    ids = padded(ids.index_select(0, keep), 0, kept)
                    temperature = padded(temperature.index_select(0, keep), pad_temperature, kept)
                    top_p = padded(top_p.index_select(0, keep), 1.0, kept)
                    keys = padded(keys.index_select(0, keep), 0, kept)
                    counts = counts.new_zeros(width)
                    history = history.new_zeros(width, self.read_every)
                    live, alive = [live[b] for b in keep.tolist()], [True] * kept
            attend[:, 0, 0, written] = True
            counts.fill_(made)
            if self.compiled and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._step(ids, next_pos, attend, cache)
            # the choice runs eagerly on the device, before the next replay overwrites the graph's logits
            # (inductor cannot yet fuse the CDF's scan with the reductions beside it on CUDA)
            picked = pick_tokens(logits, temperature, top_p, keys, counts, **flags)
            history[:, held] = picked
            ids[:, 0] = picked
            next_pos += 1
            written += 1
            held += 1
            made += 1
        return list(zip(tokens, reasons, strict=True))
