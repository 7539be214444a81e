"""Raw engine output -> :class:`~elm_memory.backends.base.Generation`, one convention for every backend.

The transformers backend and both vLLM backends decode with different engines but must return
the same completions: the same EOS ids, the EOS left out of ``token_ids``, the same
``finish_reason`` and the same ``stop_at_answer`` cut (right after the token that closes a
non-empty ``\\boxed{...}``). These rules live here once, so the backends cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elm_memory.answers import is_answer_closed
from elm_memory.backends.base import Generation
from elm_memory.errors import BackendError


def eos_ids_of(configured: int | Sequence[int] | None, tokenizer: Any) -> list[int]:
    """The generation config's EOS id(s), then the tokenizer's when it is not among them."""
    ids = [int(configured)] if isinstance(configured, int) else [int(e) for e in configured or ()]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def eos_ids_from_folder(model_dir: str | Path | None, tokenizer: Any) -> list[int]:
    """:func:`eos_ids_of` with the configured ids read from the folder's ``generation_config.json``,
    for engines that do not load the transformers model. Raises :class:`BackendError` when there is none."""
    configured = None
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        try:
            configured = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            configured = None
    ids = eos_ids_of(configured if isinstance(configured, int | list) else None, tokenizer)
    if not ids:
        raise BackendError("the model has no EOS token id (generation_config.json or tokenizer)")
    return ids


def answer_closed_after(
    tokenizer: Any, token_ids: Sequence[int], last: int, has_brace: dict[int, bool] | None = None
) -> bool:
    """Whether the completion ``token_ids`` (ending in ``last``) now holds a closed ``\\boxed{}`` answer.

    Only a token whose text contains ``}`` can close a box, so the completion is decoded again
    only after one: cheap enough to ask after every generated token. ``has_brace`` caches the
    per-token test across calls."""
    brace = has_brace.get(last) if has_brace is not None else None
    if brace is None:
        brace = "}" in tokenizer.decode([last])
        if has_brace is not None:
            has_brace[last] = brace
    return brace and is_answer_closed(tokenizer.decode(list(token_ids), skip_special_tokens=True))


def answer_cut(tokenizer: Any, token_ids: Sequence[int]) -> int | None:
    """Length of the shortest prefix that holds a closed ``\\boxed{}`` answer, None if none does."""
    for i, t in enumerate(token_ids):
        if answer_closed_after(tokenizer, token_ids[: i + 1], t):
            return i + 1
    return None


def finish_generation(
    tokenizer: Any,
    token_ids: Sequence[int],
    eos_ids: Sequence[int],
    *,
    stop_at_answer: bool = False,
    logprobs: Sequence[float] | None = None,
    engine_reason: str | None = None,
) -> Generation:
    """Engine output -> :class:`Generation`: cut at the first EOS (left out, ``"stop"``), else the
    engine's ``"stop"`` (a stop token it did not return) or ``"answer"`` (it already stopped at the
    answer), else ``"length"``; then, with ``stop_at_answer``, the answer cut (``"answer"``).
    ``logprobs`` (one per engine token) are trimmed to the kept tokens."""
    kept: list[int] = []
    reason = engine_reason if engine_reason in ("stop", "answer") else "length"
    for t in token_ids:
        if t in eos_ids:
            reason = "stop"
            break
        kept.append(int(t))
    if stop_at_answer:
        cut = answer_cut(tokenizer, kept)
        if cut is not None:
            kept, reason = kept[:cut], "answer"
    lps = None
    if logprobs is not None:
        lps = [float(x) for x in list(logprobs)[: len(kept)]]
        if len(lps) != len(kept):
            raise BackendError(f"engine returned {len(lps)} logprobs for {len(kept)} tokens")
    text = tokenizer.decode(kept, skip_special_tokens=True)
    return Generation(text=text, token_ids=kept, finish_reason=reason, logprobs=lps)  # type: ignore[arg-type]
