"""A stream memory's bounded replay: the usable generations of earlier questions, kept with the version that
learned from them, so each later update can learn from some of them again (``stream.tuning.replay``).

Without replay an update sees one question (or ``stream.tuning.update_every`` of them), so what the memory learned
from early questions is overwritten only by later ones; replaying a few kept questions is the standard guard
against that drift in online learning. What is replayed is stored text, not a new decode: the rows the update
already learned from (those that agreed with their label), with their label. That is sound for ``sft``, whose
loss is the rows' log-likelihood under the current memory whoever drew them; a policy gradient's advantages
belong to the samples of the version being trained, so replay of stored rows is refused with ``grpo`` at load.

With ``stream.tuning.replay_samples: n`` a replayed question is **re-sampled** instead: n fresh seeded samples drawn
under the version being trained (the answer path's temperature and sample budget), scored against the kept label.
That costs a decode per update (counted in the update's time) and makes replay on-policy, so GRPO may use it too
(with n >= 2: one sample has no advantage). The kept label already passed ``stream.tuning.min_label_share`` when the
question was learned, so a re-sample is not held to it again. A re-sample that fails (an out-of-memory decode)
costs the update its replay, never its own question: the version's history says why.

The buffer is part of each version's file (its metadata, bounded by :data:`MAX_REPLAY_BYTES`), so a resume,
another learner or a rollback sees the buffer of the version it serves: a rollback returns to that version's
buffer too, and rows drawn by the versions rolled back are gone with them. It holds the questions' whole text
and the model's answers: a version file shared or exported shares them.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from elm_memory.answers import equivalent, extract_answer
from elm_memory.backends.base import PromptInput, SamplingParams, answer_budget
from elm_memory.config import ELMConfig, StreamConfig
from elm_memory.memory import MAX_HEADER_BYTES
from elm_memory.memory.ids import question_hash
from elm_memory.training.stream_samples import learnable_rows

log = logging.getLogger(__name__)

#: Longest question text a version's history keeps per question (the hash identifies it whole).
HISTORY_QUESTION_CHARS = 400
#: The most a buffer may add to a version file's metadata: half of what a memory file's header may hold (long
#: answers make a question tens of kilobytes), so a kept version is always readable. The oldest go first.
MAX_REPLAY_BYTES = MAX_HEADER_BYTES // 2
#: How many of the newest history entries :func:`turn_learned` searches (a re-run follows its stop at once).
RECENT_ENTRIES = 64


@dataclass
class PooledQuestion:
    """One question's usable generations: waiting for ``stream.tuning.update_every`` questions, or kept for replay."""

    question: str
    prompt_ids: Sequence[int]
    at: int
    completions: list[list[int]]
    weights: torch.Tensor
    label: str
    share: float
    margin: float = 1.0  # the question's weight in an update: its vote's margin (1: unweighted)
    turn: str | None = None  # the id of the turn that learned it (the graph's), kept in the version's history

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "prompt_ids": list(self.prompt_ids),
            "at": self.at,
            "completions": [list(c) for c in self.completions],
            "weights": [float(w) for w in self.weights],
            "label": self.label,
            "share": self.share,
            "margin": self.margin,
            **({"turn": self.turn} if self.turn is not None else {}),
        }

    def history_entry(self) -> dict[str, Any]:
        """What a version's history keeps of this question when an update learned from it."""
        return {
            "question": self.question[:HISTORY_QUESTION_CHARS],
            "question_hash": question_hash(self.question),
            "label": self.label,
            "label_share": round(self.share, 4),
            "label_margin": round(self.margin, 4),
            **({"turn": self.turn} if self.turn is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PooledQuestion:
        return cls(
            question=str(data["question"]),
            prompt_ids=[int(t) for t in data["prompt_ids"]],
            at=int(data["at"]),
            completions=[[int(t) for t in c] for c in data["completions"]],
            weights=torch.tensor([float(w) for w in data["weights"]], dtype=torch.float32),
            label=str(data["label"]),
            share=float(data["share"]),
            margin=float(data.get("margin", 1.0)),
            turn=data.get("turn"),
        )


def turn_learned(turn: str, history: Sequence[Mapping[str, Any]], pooled: Sequence[PooledQuestion]) -> bool:
    """Whether turn ``turn`` has been learned from already: a newest version's history names it, or it waits in the
    pool (a graph resumed from its checkpoint re-runs the learn node it stopped in, perhaps after its update)."""
    if any(p.turn == turn for p in pooled):
        return True
    for entry in history[-RECENT_ENTRIES:]:
        if entry.get("turn") == turn or any(b.get("turn") == turn for b in entry.get("batch", ())):
            return True
    return False


def update_entry(
    version: int,
    trained_from: int,
    objective: str,
    batch: Sequence[PooledQuestion],
    replayed: Sequence[PooledQuestion],
    resampled: Any = None,
) -> dict[str, Any]:
    """The history entry of the version one update wrote: the batch's last question (``label`` stays its, so counting
    updates by labels is the same whatever the batch), the batch's others, the replayed questions by hash and every
    re-sampled one (those dropped, with no row to learn from, too)."""
    entry = {"version": version, **batch[-1].history_entry(), "objective": objective, "trained_from": trained_from}
    if len(batch) > 1:
        entry["batch"] = [b.history_entry() for b in batch]
    if replayed:
        entry["replayed"] = [question_hash(b.question) for b in replayed]
    if resampled is not None:
        entry["resampled"] = resampled
    return entry


class ReplayBuffer:
    """The newest ``capacity`` questions an update learned from; ``draw`` picks earlier ones to learn from again.

    With ``keep_rows=False`` (re-sampled replay: fresh rows are drawn for every replayed question) a kept question
    is stored without its rows, so more questions fit ``max_bytes``; a buffer that keeps rows draws only questions
    that have them (a version written with re-sampling on, resumed with it off)."""

    def __init__(
        self,
        capacity: int,
        items: Sequence[PooledQuestion] = (),
        *,
        keep_rows: bool = True,
        max_bytes: int = MAX_REPLAY_BYTES,
    ):
        if capacity < 1:
            raise ValueError(f"a replay buffer holds at least one question, got capacity {capacity}")
        self.capacity = capacity
        self.keep_rows = keep_rows
        self.max_bytes = max_bytes
        self.items: list[PooledQuestion] = []
        self._keep(list(items))

    @classmethod
    def for_config(cls, stream: StreamConfig, data: Sequence[Mapping[str, Any]] | None = None) -> ReplayBuffer:
        """The buffer ``stream`` asks for, holding ``data`` (a version file's stored buffer)."""
        items = [PooledQuestion.from_json(d) for d in data or []]
        return cls(stream.tuning.replay_buffer, items, keep_rows=not stream.tuning.replay_samples)

    def _keep(self, items: list[PooledQuestion]) -> None:
        """The newest ``capacity`` of ``items`` whose stored form fits ``max_bytes``."""
        if not self.keep_rows:
            items = [replace(q, completions=[], weights=torch.zeros(0)) for q in items]
        kept: list[PooledQuestion] = []
        size = 2  # the JSON list's brackets
        for item in reversed(items[-self.capacity :]):
            size += len(json.dumps(item.to_json())) + 2
            if size > self.max_bytes:
                break
            kept.append(item)
        self.items = kept[::-1]

    def __len__(self) -> int:
        return len(self.items)

    def draw(self, n: int, *, seed: int, exclude: Sequence[PooledQuestion] = ()) -> list[PooledQuestion]:
        """Up to ``n`` kept questions, chosen uniformly with ``seed`` (the same version draws the same ones), none
        of the questions in ``exclude`` (the update's own), and, when the buffer learns from stored rows, none
        stored without them."""
        hashes = {question_hash(q.question) for q in exclude}
        candidates = [
            q for q in self.items if question_hash(q.question) not in hashes and (q.completions or not self.keep_rows)
        ]
        if n <= 0 or not candidates:
            return []
        return random.Random(seed).sample(candidates, min(n, len(candidates)))

    def add(self, batch: Sequence[PooledQuestion]) -> None:
        """Keep ``batch`` (the questions an update just learned from), dropping the oldest beyond capacity or
        beyond ``max_bytes``; a question asked again replaces its older entry."""
        hashes = {question_hash(q.question) for q in batch}
        self._keep([q for q in self.items if question_hash(q.question) not in hashes] + list(batch))

    def to_json(self) -> list[dict[str, Any]]:
        return [q.to_json() for q in self.items]


def replay_params(
    config: Any, backend: Any, items: Sequence[PooledQuestion], *, reserve: int, seed: int
) -> SamplingParams:
    """The re-sampling call's settings: the answer path's samples' temperature and budget (the sampling verifier's,
    cut to the answer's), cut to the context the longest prompt leaves after ``reserve`` memory tokens."""
    limit = min(config.verifier.consistency_max_new_tokens, config.generation.max_new_tokens)
    max_context = getattr(getattr(backend, "info", None), "max_context", None)
    longest = max(len(b.prompt_ids) for b in items)
    return SamplingParams(
        max_new_tokens=limit if max_context is None else answer_budget(limit, max_context, longest, reserve),
        temperature=config.verifier.consistency_temperature,
        top_p=config.generation.top_p,
        seed=seed,
        stop_at_answer=True,  # only the first box is read, as for the answer path's samples
    )


def resample(
    items: Sequence[PooledQuestion],
    *,
    serve: Callable[[Sequence[PromptInput], int], list[PromptInput]],
    backend: Any,
    params: SamplingParams,
    n: int,
    seed: int,
    objective: str,
) -> tuple[list[PooledQuestion], list[dict[str, Any]]]:
    """Kept questions with fresh rows: ``n`` seeded samples each under the serving version (``serve`` puts the
    memory on a question's rows), drawn in one call and scored against the question's kept label; a question
    keeps the rows ``objective`` learns from, and is dropped when there are none. Also, per question, how many
    samples agreed with its label (what the version's history records)."""
    rng = random.Random(seed)
    rows: list[PromptInput] = []
    for item in items:
        seeds = [rng.randrange(2**31) for _ in range(n)]
        rows.extend(serve([PromptInput(tuple(item.prompt_ids), seed=s) for s in seeds], item.at))
    drawn = [gens[0] for gens in backend.generate(rows, replace(params, n=1))] if rows else []
    kept: list[PooledQuestion] = []
    notes: list[dict[str, Any]] = []
    for j, item in enumerate(items):
        gens = drawn[j * n : (j + 1) * n]
        rewards = [1.0 if equivalent(extract_answer(g.text), item.label) else 0.0 for g in gens]
        picked, weights = learnable_rows(rewards, [True] * len(gens), objective)
        notes.append({"question_hash": question_hash(item.question), "agreeing": int(sum(rewards)), "of": n})
        if picked:
            completions = [list(gens[i].token_ids) for i in picked]
            kept.append(replace(item, completions=completions, weights=weights, share=sum(rewards) / n))
    return kept, notes


def resample_kept(
    items: Sequence[PooledQuestion],
    config: ELMConfig,
    backend: Any,
    server: Callable[[], Callable[[Sequence[PromptInput], int], list[PromptInput]]],
    seed: int,
) -> tuple[list[PooledQuestion], list[dict[str, Any]]]:
    """:func:`resample` for one stream-memory update: ``server()`` gives one copy of the serving version for every
    question (for a LoRA, one adapter object, so one decode batch); the answer path's budget (the memory's k tokens
    reserved, as there). A failed decode, or a serving copy that cannot be built, drops the replay, not the update:
    every question's note carries the error instead of its count."""
    params = replay_params(config, backend, items, reserve=config.memory.num_tokens, seed=seed)
    try:
        return resample(
            items,
            serve=server(),
            backend=backend,
            params=params,
            n=config.stream.tuning.replay_samples,
            seed=seed,
            objective=config.stream.tuning.objective,
        )
    except Exception as exc:  # the question's own rows are in hand: learn from them, say what replay lost
        failed = f"{type(exc).__name__}: {exc}"[:200]
        log.warning(
            "stream memory: re-sampling %d replayed question(s) failed (%s); updating without replay",
            len(items),
            failed,
        )
        return [], [{"question_hash": question_hash(item.question), "failed": failed} for item in items]
