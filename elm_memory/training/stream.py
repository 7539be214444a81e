"""Where a stream memory is trained: one latent memory per namespace (a soft prompt, or a LoRA with
``stream.kind: lora``) that answered questions update, from the generations the answer path already drew (no
decode of its own unless ``stream.tuning.replay_samples`` re-samples replay): the memory's greedy answer and
samples, or with ``stream.tuning.learn_from: zero_shot`` zero-shot's, labelled by their vote. One update is
``grpo`` (Dr.GRPO on the samples, reward 1 where a sample equals the label; skipped when all rewards are equal) or
``sft`` (the mean log-likelihood of the rows that agree with the label), each question weighted by its vote's
margin, then clipping and one AdamW step, the base model frozen. A non-finite loss or result leaves the serving
version as it was.

Every applied update is a new version (:class:`~elm_memory.store.stream_files.StreamFiles`) written under a file
lock after re-reading the newest, so two learners of one namespace serialise. The collapse guard
(:mod:`.stream_guard`) rolls the memory back when a planned threshold breaks; the amortization gate
(:mod:`.stream_gate`) decides when the memory answers alone, and on closing restores the version it approved.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from elm_memory.answers import equivalent
from elm_memory.atomic import write_bytes_atomic
from elm_memory.backends.base import PromptInput
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError, MemoryKindError, NonFiniteError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import question_hash
from elm_memory.memory.kinds import LORA, SOFT_PROMPT
from elm_memory.models.loading import LoadedModel
from elm_memory.store.stream_files import StreamFiles, gate_summary, updates_and_rollbacks
from elm_memory.training.stream_gate import PROBATION, AmortizationGate, GateReading
from elm_memory.training.stream_guard import CollapseGuard, Observation, Verdict
from elm_memory.training.stream_replay import PooledQuestion, ReplayBuffer, resample_kept, turn_learned, update_entry
from elm_memory.training.stream_samples import Generated, learnable_rows, own_vote
from elm_memory.training.stream_serving import StreamServing
from elm_memory.training.stream_step import (
    StreamUpdate,
    _parameters,
    backward_rows,
    initial_stream_tensors,
    optimizer_moments,
    relative_distance,
    set_optimizer_moments,
)

__all__ = ["STREAM_QUESTION", "StreamMemory", "StreamUpdate"]

#: What a stream memory's file says it is (its ``question`` field: a stream memory has no one question).
STREAM_QUESTION = "stream memory of namespace {namespace}"


class StreamMemory(StreamServing):
    """One namespace's stream memory: serves its current version (:class:`StreamServing`), learns from each answered
    question."""

    def __init__(
        self,
        config: ELMConfig,
        loaded: LoadedModel,
        root: str | Path,
        namespace: str | None = None,
        *,
        backend: Any = None,
    ):
        self.config = config
        self.cfg = config.stream
        self.backend = backend  # draws replay's fresh samples (``stream.tuning.replay_samples``)
        if self.cfg.tuning.replay_samples and backend is None:
            raise ConfigError(
                f"stream.tuning.replay_samples={self.cfg.tuning.replay_samples} draws fresh samples for each replayed "
                "question: give the stream memory a backend (StreamMemory(..., backend=...)), or set "
                "stream.tuning.replay_samples=0"
            )
        self.kind = SOFT_PROMPT if self.cfg.kind == "soft_prompt" else LORA
        self.loaded = loaded
        self.namespace = namespace or config.namespace
        self.files = StreamFiles(root, self.namespace)
        self.guard = CollapseGuard.from_settings(self.cfg.tuning)
        self.temperature = config.verifier.consistency_temperature  # what the answer path's samples used
        self.pooled: list[PooledQuestion] = []  # waiting for a batch (tuning.update_every > 1): see _load_pending
        # rebuilt, not stored: the same text (or seed) gives the same tensors
        self.init = initial_stream_tensors(config, loaded, self.kind)
        with self.files.lock():
            if self.files.current_version() is None:
                self._start()
            self._load_current()

    def _start(self) -> None:
        """Write version 0, the untrained memory with a fresh guard and gate (a new namespace, or a deleted stream
        memory)."""
        self.guard = CollapseGuard.from_settings(self.cfg.tuning)
        self.gate = self._gate_of(None)
        self.replay = ReplayBuffer.for_config(self.cfg)
        self.params = _parameters(self.init)
        self._served = None
        self.version = 0
        self._write(0, entry=None, optim={})

    def _gate_of(self, state: dict[str, Any] | None) -> AmortizationGate:
        return AmortizationGate.from_settings(state, self.cfg.tuning)

    def read_gate_state(self) -> str:
        """``warmup`` | ``serving`` | ``probation`` on disk now (a cheap read, no lock: what a turn plans with)."""
        stored = self.files.read_gate()
        return str(stored.get("state", self.gate.state)) if stored else self.gate.state

    def _load_current(self) -> None:
        memory, optim = self.files.read()
        if memory.kind != self.kind:
            raise MemoryKindError(
                f"the stream memory of {self.namespace!r} on disk is a {memory.kind} memory but stream.kind is "
                f"{self.cfg.kind}: use another store path or namespace, or set stream.kind={memory.kind}"
            )
        meta = memory.meta.config["stream"]
        self.version = int(meta["version"])
        self.history: list[dict[str, Any]] = self.files.repair_history(memory)  # callers hold the lock
        self.gate = self._gate_of(self.files.read_gate())
        self.params = _parameters(memory.params)
        self._served = None
        self.replay = self._replay_of(memory)
        self._new_optimizer(optim)
        guard_state = meta.get("guard")
        if guard_state is not None:
            self.guard.restore(guard_state)
        self._load_pending()

    # -- what learning holds between versions ---------------------------------------------
    def _load_pending(self) -> None:
        """The guard's readings and the pooled questions since the serving version, as the namespace's last learner
        left them (this process before a restart, or another; call under the lock)."""
        held = self.files.read_pending(self.version)
        if held is None:
            self.pooled = []
            return
        self.guard.restore(held["guard"])
        self.pooled = [PooledQuestion.from_json(p) for p in held["pooled"]]

    def _save_pending(self) -> None:
        pooled = [p.to_json() for p in self.pooled]
        self.files.write_pending({"version": self.version, "guard": self.guard.state(), "pooled": pooled})

    def pending_state(self) -> dict[str, Any]:
        """What a record keeps of it after its question: the guard's state and the pooled questions' hashes."""
        return {"guard": self.guard.state(), "pooled": [question_hash(p.question) for p in self.pooled]}

    def restore_pending(self, state: dict[str, Any]) -> None:
        """Put the guard and the pool back as :meth:`pending_state` saw them: a resumed evaluation answers again the
        question after its last record, which the guard may have read and the pool held already. (A pool that an
        update used after the last record is lost with the version the resume undoes.)"""
        with self.files.lock():
            self.guard.restore(state["guard"])
            recorded = Counter(state["pooled"])
            kept = []
            for p in self.pooled:
                if recorded[h := question_hash(p.question)] > 0:
                    recorded[h] -= 1
                    kept.append(p)
            self.pooled = kept
            self._save_pending()

    def _replay_of(self, memory: LatentMemory) -> ReplayBuffer:
        """The replay buffer a version's file holds (empty when replay was off)."""
        return ReplayBuffer.for_config(self.cfg, memory.meta.config["stream"].get("replay"))

    def _new_optimizer(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """AdamW over the memory's tensors, with the moments ``state`` holds (none: fresh)."""
        self.optim = torch.optim.AdamW(list(self.params.values()), lr=self.cfg.lr, weight_decay=0.0)
        if state:
            self._set_optimizer_state(state)

    def _optimizer_state(self) -> dict[str, torch.Tensor]:
        return optimizer_moments(self.optim, self.params, prefixed=self.kind != SOFT_PROMPT)

    def _set_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        set_optimizer_moments(self.optim, self.params, state, prefixed=self.kind != SOFT_PROMPT)

    def _copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the memory's tensors to ``tensors`` (an earlier version's), in place."""
        if set(tensors) != set(self.params):
            raise MemoryKindError(f"stream memory version tensors {sorted(tensors)[:3]} do not match the memory's")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[name].to(torch.float32))
        self._served = None

    def moved(self) -> float:
        """||memory - init|| / ||init|| over all its tensors."""
        return relative_distance(self.params, self.init)

    def refresh(self) -> bool:
        """Serve the newest version on disk (another learner may have written it). True when the stream memory
        was deleted (``elm memories delete --stream``): it starts again from the untrained memory."""
        current = self.files.current_version()
        if current is None:
            self._start()
            self._load_current()
            return True
        if current != self.version:
            self._load_current()
        else:
            self._load_pending()  # another learner may have read or pooled a question since
        return False

    def pinned_versions(self) -> set[int]:
        """The versions a rollback may return to, kept whatever ``stream.keep_versions`` says: the one the gate
        approved, and the one that answered the guard window's first question (the current one when the window
        is empty)."""
        pinned = {self.guard.pending[0].version if self.guard.pending else self.version}
        if self.gate.approved_version is not None:
            pinned.add(self.gate.approved_version)
        return pinned

    def _write(self, version: int, *, entry: dict[str, Any] | None, optim: dict[str, torch.Tensor]) -> None:
        """Write ``version`` (its header holds its own history entry, not the whole history), then append the entry
        to the namespace's log and prune."""
        info = self.loaded.info
        meta = {
            "version": version,
            "namespace": self.namespace,
            "objective": self.cfg.tuning.objective,
            "recipe": self.cfg.model_dump(mode="json"),
            "entry": entry,
            "guard": self.guard.state(),
            **({"replay": self.replay.to_json()} if self.cfg.tuning.replay else {}),
        }
        tensors = {"adapter": self.adapter()} if self.kind == LORA else {"soft_prompt": self.soft_prompt}
        memory = LatentMemory.create(
            **tensors,
            question=STREAM_QUESTION.format(namespace=self.namespace),
            namespace=self.namespace,
            model=info,
            config={"stream": meta, "soft_prompt_position": self.config.prompt.soft_prompt_position},
            memory_id=uuid.uuid4().hex,  # a memory id is hex; the version is in the metadata
        )
        self.files.write(version, memory, optim)
        if entry is not None:
            self.files.append_history([entry])
        self.files.prune(self.cfg.versions_to_keep, pinned=self.pinned_versions() | {version})
        self.files.prune_moments()

    # -- learning ----------------------------------------------------------------------
    def learn(
        self,
        question: str,
        prompt_ids: Sequence[int],
        at: int,
        generations: Sequence[Generated],
        *,
        label: str | None,
        version_used: int,
        zero_shot_answer: str | None,
        served_answers: Sequence[str | None] | None = None,
        gate_reading: GateReading | None = None,
        margin: float = 1.0,
        turn: str | None = None,
    ) -> StreamUpdate:
        """Read the question's answers into the guard (and ``gate_reading`` into the gate), then update the memory
        once from ``generations`` (under the lock). ``served_answers``: what the memory itself answered (greedy
        first, then its samples; none: it drew none), when ``generations`` are not its own (``learn_from: zero_shot``):
        the guard watches the memory. ``margin``: the label's vote margin, the question's weight in the update.
        ``turn``: the graph turn's id; a turn learned from already is skipped and one the gate read is not read again
        (a graph resumed from its checkpoint re-runs the learn node it stopped in)."""
        t0 = time.perf_counter()
        with self.files.lock():
            deleted = self.refresh()
            update = StreamUpdate(version_used=version_used, version=self.version, label=label)
            # deleted: drawn with a memory that no longer exists, not the new one's experience
            learned = turn is not None and turn_learned(turn, self.history, self.pooled)
            if deleted or learned:
                update.skipped = "stream_deleted" if deleted else "learned_already"
                update.seconds = round(time.perf_counter() - t0, 3)
                return update
            closed = False
            if gate_reading is not None:
                closed = self._read_gate(update, gate_reading, version_used, question, turn)
            served = list(served_answers) if served_answers is not None else [g.answer for g in generations]
            verdict = self.guard.observe(Observation(version_used, served, zero_shot_answer, own_vote(served), turn))
            if verdict is not None:
                update.guard = verdict.to_dict()
            if closed:  # drawn with the version the gate just stopped: the approved one serves again
                update.skipped, update.version = "gate_closed", self.version
            elif verdict is not None and verdict.rollback_to is not None:
                self._roll_back(verdict, question)
                update.skipped, update.version = "rolled_back", self.version
            elif any(v > version_used for v in self._rollback_versions()):
                # drawn with a version that has been rolled back since: not the serving line's experience
                update.skipped = "drawn_before_rollback"
            else:
                self._update(update, question, prompt_ids, at, generations, margin, turn)
            self._save_pending()
        update.seconds = round(time.perf_counter() - t0, 3)
        return update

    def _read_gate(
        self, update: StreamUpdate, reading: GateReading, version_used: int, question: str, turn: str | None
    ) -> bool:
        """One gate reading (under the lock); True when it closed the gate and the approved version serves again."""
        self.gate = self._gate_of(self.files.read_gate())  # another learner may have read a question since
        if turn is not None and turn in self.gate.read_turns:  # read before this turn's learning stopped
            update.gate = {**self.gate.record(reading), "read_already": True}
            return False
        decision = self.gate.observe(reading, version_used, turn=turn)
        update.gate = self.gate.record(reading)
        closed = False
        if decision is not None:
            update.gate_decision = decision.to_dict()
            entry = {"gate": decision.to_dict(), "at_version": self.version, "question_hash": question_hash(question)}
            self.history.append(entry)
            self.files.append_history([entry])
            approved = decision.approved_version
            if decision.state == PROBATION and approved is not None and approved != self.version:
                self._restore(approved, reason=f"gate closed: {decision.reason}")
                closed = True
        self.files.write_gate(self.gate.to_json())
        return closed

    def restore_gate(self, state: dict[str, Any], *, reason: str) -> bool:
        """Put the gate back to ``state`` (a resumed evaluation: what its last record saw); True when it changed."""
        with self.files.lock():
            entry = self.files.restore_gate(state, reason=reason, at_version=self.version)
            if entry is not None:
                self.history.append(entry)
                self.gate = self._gate_of(state)
        return entry is not None

    def _rollback_versions(self) -> set[int]:
        return {h["version"] for h in self.history if h.get("rollback_to") is not None}

    def _update(
        self,
        update: StreamUpdate,
        question: str,
        prompt_ids: Sequence[int],
        at: int,
        generations: Sequence[Generated],
        margin: float = 1.0,
        turn: str | None = None,
    ) -> None:
        label = update.label
        rewards = [1.0 if label is not None and equivalent(g.answer, label) else 0.0 for g in generations]
        update.rewards = rewards
        share = sum(rewards) / max(1, len(rewards))
        if label is None:
            update.skipped = "no_label"
            return
        if share < self.cfg.tuning.min_label_share:
            update.skipped = "weak_label"
            return
        rows, weights = learnable_rows(rewards, [g.sampled for g in generations], self.cfg.tuning.objective)
        if not rows:
            update.skipped = "uniform_rewards" if self.cfg.tuning.objective == "grpo" else "no_agreeing"
            return
        completions = [list(generations[i].token_ids) for i in rows]
        self.pooled.append(PooledQuestion(question, prompt_ids, at, completions, weights, label, share, margin, turn))
        if len(self.pooled) < self.cfg.tuning.update_every:
            update.skipped = f"pooled ({len(self.pooled)} of {self.cfg.tuning.update_every})"
            return
        batch, self.pooled = self.pooled, []
        self._step(update, batch)

    def _step(self, update: StreamUpdate, batch: list[PooledQuestion]) -> None:
        """One optimizer step over the batch's generations and ``stream.tuning.replay`` kept questions (each question's
        loss weighted 1 / their number)."""
        before = self._optimizer_state()
        old = {n: p.detach().clone() for n, p in self.params.items()}
        # seeded by the version and the update's question: reproducible, and a failed draw is not redrawn forever
        seed = (self.config.training.seed or 0) + self.version + int(question_hash(batch[-1].question)[:8], 16)
        replayed = self.replay.draw(self.cfg.tuning.replay, seed=seed, exclude=batch)
        drawn = None
        if replayed and self.cfg.tuning.replay_samples:
            replayed, drawn = resample_kept(replayed, self.config, self.backend, self.server, seed)
        items = batch + replayed
        # each question weighs its vote's margin: within the step by its share of the loss, and the step itself by
        # the items' mean margin through the learning rate (AdamW would undo a loss scale on its own)
        margins = [max(b.margin, 1e-6) for b in items]
        total = sum(margins)
        self.optim.zero_grad(set_to_none=True)
        try:
            loss = sum(
                self._backward(b.prompt_ids, b.at, b.completions, b.weights, m / total)
                for b, m in zip(items, margins, strict=True)
            )
            norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.tuning.max_grad_norm))
            for group in self.optim.param_groups:
                group["lr"] = self.cfg.lr * total / len(items)
            self.optim.step()
            self._served = None
            finite = all(bool(torch.isfinite(p).all()) for p in self.params.values())
            if not (finite and torch.isfinite(torch.tensor(norm))):
                raise NonFiniteError(f"stream memory update from version {self.version} is non-finite")
        except NonFiniteError:
            self._copy_in(old)  # the last good version keeps serving
            self.optim.state.clear()
            self._set_optimizer_state(before)
            update.skipped = "non_finite"
            return
        version = self.version + 1
        entry = update_entry(version, self.version, self.cfg.tuning.objective, batch, replayed, drawn)
        if self.cfg.tuning.replay:
            self.replay.add(batch)
        self.history.append(entry)
        self._write(version, entry=entry, optim=self._optimizer_state())
        self.version = version
        update.applied, update.version = True, version
        update.loss, update.grad_norm = round(loss, 6), round(norm, 6)
        update.moved = round(self.moved(), 6)

    def _backward(
        self,
        prompt_ids: Sequence[int],
        at: int,
        completions: list[list[int]],
        weights: torch.Tensor,
        scale: float = 1.0,
    ) -> float:
        if self.kind == SOFT_PROMPT:
            prompt = PromptInput(tuple(prompt_ids), soft_prompt=self.soft, soft_prompt_at=at)
        else:  # gradients reach A and B through the hooks
            prompt = PromptInput(tuple(prompt_ids), memory=self.adapter(trainable=True))
        return backward_rows(
            self.loaded,
            prompt,
            completions,
            weights,
            objective=self.cfg.tuning.objective,
            temperature=self.temperature,
            scale=scale,
        )

    def _roll_back(self, verdict: Verdict, question: str) -> None:
        """A new version holding the tensor of ``verdict.rollback_to``, with a fresh optimizer."""
        assert verdict.rollback_to is not None
        target, _ = self.files.read(verdict.rollback_to)
        version = self.version + 1
        entry = verdict.rollback_entry(version, question_hash(question))
        self.history.append(entry)
        self._copy_in(target.params)
        self._new_optimizer()
        self.replay = self._replay_of(target)
        self.pooled = []  # drawn with the versions rolled back
        self._write(version, entry=entry, optim={})
        self.version = version

    def restore_version(self, version: int, *, reason: str) -> None:
        """Serve ``version`` again (its tensor, and its optimizer moments where still kept: else a fresh optimizer)
        as a new version; the history says why."""
        with self.files.lock():
            self._restore(version, reason=reason)

    def _restore(self, version: int, *, reason: str) -> None:
        """:meth:`restore_version` under the lock."""
        memory, optim = self.files.read(version)
        new = self.files.current_version()
        new = (new if new is not None else self.version) + 1
        entry = {"version": new, "rollback_to": version, "reasons": [reason]}
        self.history.append(entry)
        self.pooled = []
        self._copy_in(memory.params)
        self.replay = self._replay_of(memory)
        self._new_optimizer(optim)
        self._write(new, entry=entry, optim=optim)
        self.version = new

    def summary(self) -> dict[str, Any]:
        """Kind, version, updates, rollbacks and distance from the init (for listings and records)."""
        return {
            "namespace": self.namespace,
            "kind": self.kind,
            "version": self.version,
            **updates_and_rollbacks(self.history),
            "moved": round(self.moved(), 6),
            "gate": gate_summary(self.files.read_gate(), self.history),
        }

    def write_summary(self, path: str | Path) -> None:
        write_bytes_atomic(path, json.dumps(self.summary(), indent=2).encode())
