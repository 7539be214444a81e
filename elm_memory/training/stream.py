"""Where a stream memory is trained: one soft prompt per namespace that every answered question updates once,
from the generations the answer path already drew with it (no extra decode).

One update, given a question's prompt, the memory's greedy answer and samples (drawn with the version that
serves) and the label (the vote the answer path returned):

- ``grpo``: Dr.GRPO on the samples, reward 1 where a sample's answer equals the label, advantage r - mean(r);
  skipped when every sample gets the same reward (no gradient);
- ``sft``: self-distillation, the mean log-likelihood of the generations (greedy and samples) that agree with
  the label; skipped when none does;

then gradient clipping and one AdamW step on the soft prompt, the base model frozen. A non-finite loss or
result leaves the serving version as it was. Every applied update is written as a new version
(:class:`~elm_memory.store.stream_files.StreamFiles`) under a file lock, after re-reading the newest version,
so two learners of one namespace serialise. The collapse guard (:mod:`.stream_guard`) reads each question's
answers and rolls the memory back to an earlier version when a planned threshold breaks.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elm_memory.answers import equivalent
from elm_memory.atomic import write_bytes_atomic
from elm_memory.backends.base import GenerateRequest, PromptInput, SamplingParams
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import ELMConfig
from elm_memory.errors import NonFiniteError
from elm_memory.memory import LatentMemory
from elm_memory.memory.ids import question_hash
from elm_memory.memory.init import init_soft_prompt
from elm_memory.models.loading import LoadedModel
from elm_memory.store.stream_files import StreamFiles
from elm_memory.training.losses import advantages_from_rewards, policy_loss, sft_loss
from elm_memory.training.stream_guard import CollapseGuard, Observation, Verdict

#: What a stream memory's file says it is (its ``question`` field: a stream memory has no one question).
STREAM_QUESTION = "stream memory of namespace {namespace}"
#: Longest question text kept per history entry in a version's file (the hash identifies it whole).
HISTORY_QUESTION_CHARS = 400


def answer_budget_samples(sampler: Any, question: str, prompt: Any, answer: SamplingParams) -> GenerateRequest:
    """The sampling verifier's seeded rows for ``question`` (from ``prompt``'s zero-shot form), their budget cut
    to the answer's: the samples a stream memory votes over and learns from are answers like its greedy one."""
    rows, params = sampler.sample_request(question, prompt.zero_shot())
    return rows, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, answer.max_new_tokens))


def under_soft_prompt(rows: Sequence[Any], soft: torch.Tensor, at: int) -> list[PromptInput]:
    """The same rows (seeds kept) with the stream memory's soft prompt inserted at ``at``: on-policy samples."""
    return [dataclasses.replace(p, soft_prompt=soft, soft_prompt_at=at) for p in rows]


@dataclass(frozen=True)
class Generated:
    """One generation the answer path drew with the stream memory: its tokens and final answer."""

    token_ids: Sequence[int]
    answer: str | None
    sampled: bool  # a sample (on-policy for GRPO), not the greedy answer


@dataclass
class StreamUpdate:
    """What one question did to the stream memory (recorded with the answer)."""

    version_used: int  # the version that drew the generations
    version: int  # the version that serves after this question
    label: str | None
    rewards: list[float] = field(default_factory=list)
    applied: bool = False
    skipped: str | None = None  # why no update: "uniform_rewards" | "no_agreeing" | "weak_label" | "rolled_back" | ...
    loss: float | None = None
    grad_norm: float | None = None
    moved: float | None = None  # ||soft - init|| / ||init|| after the update
    seconds: float = 0.0
    guard: dict[str, Any] | None = None  # the window's verdict, when this question closed one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pooled:
    """One question's usable generations, waiting for ``stream.update_every`` questions to fill a batch."""

    question: str
    prompt_ids: Sequence[int]
    at: int
    completions: list[list[int]]
    weights: torch.Tensor
    label: str
    share: float


class StreamMemory:
    """One namespace's stream memory: serves its current version, learns from each answered question."""

    def __init__(self, config: ELMConfig, loaded: LoadedModel, root: str | Path, namespace: str | None = None):
        self.config = config
        self.cfg = config.stream
        self.loaded = loaded
        self.namespace = namespace or config.namespace
        self.files = StreamFiles(root, self.namespace)
        self.guard = CollapseGuard(
            window=self.cfg.guard_window,
            max_unboxed_increase=self.cfg.guard_max_unboxed_increase,
            max_agreement_drop=self.cfg.guard_max_agreement_drop,
            max_repeated_answer=self.cfg.guard_max_repeated_answer,
        )
        self.temperature = config.verifier.consistency_temperature  # what the answer path's samples used
        self.pooled: list[_Pooled] = []  # questions waiting for a batch (stream.update_every > 1), this process only
        with self.files.lock():
            if self.files.current_version() is None:
                init = self.initial_soft_prompt()
                self._write(0, init, history=[], optim={})
            self._load_current()

    # -- state -----------------------------------------------------------------------
    def initial_soft_prompt(self) -> torch.Tensor:
        """The untrained stream memory: the format instruction's token embeddings, tiled to k (or random)."""
        k = self.config.memory.num_tokens
        ids = self.loaded.tokenizer(self.cfg.format_instruction, add_special_tokens=False)["input_ids"]
        mode = "question" if self.cfg.init == "instruction" else "random"
        return init_soft_prompt(self.loaded.model.get_input_embeddings(), ids, k, mode, self.config.training.seed)

    @property
    def soft_prompt(self) -> torch.Tensor:
        """The serving version's soft prompt (a copy: later updates do not change it)."""
        return self.soft.detach().clone()

    def _load_current(self) -> None:
        memory, optim = self.files.read()
        meta = memory.meta.config["stream"]
        self.version = int(meta["version"])
        self.init = self.initial_soft_prompt()  # rebuilt, not stored: the same text (or seed) gives the same tensor
        self.history: list[dict[str, Any]] = list(meta.get("history", []))
        self.soft = torch.nn.Parameter(memory.soft_prompt.detach().to(torch.float32).clone())
        self.optim = torch.optim.AdamW([self.soft], lr=self.cfg.learning_rate, weight_decay=0.0)
        if optim:
            self.optim.state[self.soft] = {k: v.clone() for k, v in optim.items()}
        guard_state = meta.get("guard")
        if guard_state is not None:
            self.guard.restore(guard_state)

    def refresh(self) -> None:
        """Serve the newest version on disk (another learner may have written it)."""
        current = self.files.current_version()
        if current is not None and current != self.version:
            served = self.version
            self._load_current()
            if any(v > served for v in self._rollback_versions()):
                self.pooled = []  # drawn with versions that have since been rolled back

    def _write(
        self,
        version: int,
        soft: torch.Tensor,
        *,
        history: list[dict[str, Any]],
        optim: dict[str, torch.Tensor],
    ) -> None:
        info = self.loaded.info
        meta = {
            "version": version,
            "namespace": self.namespace,
            "objective": self.cfg.objective,
            "recipe": self.cfg.model_dump(mode="json"),
            "history": history,
            "guard": self.guard.state(),
        }
        memory = LatentMemory.create(
            soft.detach().to(torch.float32).clone(),
            question=STREAM_QUESTION.format(namespace=self.namespace),
            namespace=self.namespace,
            model=info,
            config={"stream": meta, "soft_prompt_position": self.config.prompt.soft_prompt_position},
            memory_id=uuid.uuid4().hex,  # a memory id is hex; the version is in the metadata
        )
        self.files.write(version, memory, optim)
        self.files.prune(self.cfg.versions_to_keep)

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
    ) -> StreamUpdate:
        """Read the question's answers into the guard, then update the memory once from them (under the lock)."""
        t0 = time.perf_counter()
        with self.files.lock():
            self.refresh()
            update = StreamUpdate(version_used=version_used, version=self.version, label=label)
            verdict = self.guard.observe(
                Observation(version_used, [g.answer for g in generations], zero_shot_answer, label)
            )
            if verdict is not None:
                update.guard = verdict.to_dict()
            if verdict is not None and verdict.rollback_to is not None:
                self._roll_back(verdict, question)
                update.skipped, update.version = "rolled_back", self.version
            elif any(v > version_used for v in self._rollback_versions()):
                # drawn with a version that has been rolled back since: not the serving line's experience
                update.skipped = "drawn_before_rollback"
            else:
                self._update(update, question, prompt_ids, at, generations)
        update.seconds = round(time.perf_counter() - t0, 3)
        return update

    def _rollback_versions(self) -> set[int]:
        return {h["version"] for h in self.history if h.get("rollback_to") is not None}

    def _update(
        self,
        update: StreamUpdate,
        question: str,
        prompt_ids: Sequence[int],
        at: int,
        generations: Sequence[Generated],
    ) -> None:
        label = update.label
        rewards = [1.0 if label is not None and equivalent(g.answer, label) else 0.0 for g in generations]
        update.rewards = rewards
        share = sum(rewards) / max(1, len(rewards))
        if label is None:
            update.skipped = "no_label"
            return
        if share < self.cfg.min_label_share:
            update.skipped = "weak_label"
            return
        if self.cfg.objective == "grpo":
            rows = [i for i, g in enumerate(generations) if g.sampled]
            r = torch.tensor([rewards[i] for i in rows], dtype=torch.float32)
            if len(rows) < 2 or bool((r == r[0]).all()):
                update.skipped = "uniform_rewards"
                return
            weights = advantages_from_rewards(r, scale=False)
        else:
            rows = [i for i, g in enumerate(generations) if rewards[i] > 0]
            weights = torch.ones(len(rows))
        completions = [list(generations[i].token_ids) for i in rows]
        self.pooled.append(_Pooled(question, prompt_ids, at, completions, weights, label, share))
        if len(self.pooled) < self.cfg.update_every:
            update.skipped = f"pooled ({len(self.pooled)} of {self.cfg.update_every})"
            return
        batch, self.pooled = self.pooled, []
        self._step(update, batch)

    def _step(self, update: StreamUpdate, batch: list[_Pooled]) -> None:
        """One optimizer step over the batch's generations (each question's loss weighted 1/len(batch))."""
        before = {k: v.clone() for k, v in self.optim.state.get(self.soft, {}).items()}
        old = self.soft.detach().clone()
        self.optim.zero_grad(set_to_none=True)
        try:
            loss = sum(self._backward(b.prompt_ids, b.at, b.completions, b.weights, 1 / len(batch)) for b in batch)
            norm = float(torch.nn.utils.clip_grad_norm_([self.soft], self.cfg.max_grad_norm))
            self.optim.step()
            if not (torch.isfinite(self.soft).all() and torch.isfinite(torch.tensor(norm))):
                raise NonFiniteError(f"stream memory update from version {self.version} is non-finite")
        except NonFiniteError:
            with torch.no_grad():  # the last good version keeps serving
                self.soft.copy_(old)
            self.optim.state[self.soft] = before
            update.skipped = "non_finite"
            return
        version = self.version + 1
        entry = {
            "version": version,
            **_trained_on(batch[-1]),
            "objective": self.cfg.objective,
            "trained_from": self.version,
        }
        if len(batch) > 1:  # the batch's other questions too; "label" stays the last one's, so counting is the same
            entry["batch"] = [_trained_on(b) for b in batch]
        self.history.append(entry)
        state = self.optim.state[self.soft]
        self._write(version, self.soft, history=self.history, optim={k: v for k, v in state.items()})
        self.version = version
        update.applied, update.version = True, version
        update.loss, update.grad_norm = round(loss, 6), round(norm, 6)
        update.moved = round(float((self.soft.detach() - self.init).norm() / self.init.norm().clamp(min=1e-12)), 6)

    def _backward(
        self,
        prompt_ids: Sequence[int],
        at: int,
        completions: list[list[int]],
        weights: torch.Tensor,
        scale: float = 1.0,
    ) -> float:
        """Backward of the objective over ``completions`` (one row at a time: a CPU keeps the peak of one)."""
        model = self.loaded.model
        pad = self.loaded.tokenizer.pad_token_id or 0
        prompt = PromptInput(tuple(prompt_ids), soft_prompt=self.soft, soft_prompt_at=at)
        total = 0.0
        n = len(completions)
        max_len = max(1, max(len(c) for c in completions))
        for comp, weight in zip(completions, weights, strict=True):
            logps, mask = completion_logprobs(model, [prompt], [comp], temperature=self.temperature, pad_id=pad)
            if self.cfg.objective == "grpo":
                loss, _ = policy_loss(
                    logps,
                    None,
                    weight.reshape(1),
                    mask,
                    beta=0.0,
                    loss_type="dr_grpo",
                    max_completion_length=max_len,
                    group_size=n,
                )
            else:
                loss = sft_loss(logps, mask) / n
            if not torch.isfinite(loss):
                raise NonFiniteError(f"stream memory loss is {loss.item()}")
            loss = loss * scale
            loss.backward()
            total += float(loss.item())
        return total

    def _roll_back(self, verdict: Verdict, question: str) -> None:
        """A new version holding the tensor of ``verdict.rollback_to``, with a fresh optimizer."""
        assert verdict.rollback_to is not None
        target, _ = self.files.read(verdict.rollback_to)
        version = self.version + 1
        self.history.append(
            {
                "version": version,
                "rollback_to": verdict.rollback_to,
                "reasons": verdict.reasons,
                "window": verdict.stats.to_dict(),
                "question_hash": question_hash(question),
            }
        )
        with torch.no_grad():
            self.soft.copy_(target.soft_prompt.to(torch.float32))
        self.optim = torch.optim.AdamW([self.soft], lr=self.cfg.learning_rate, weight_decay=0.0)
        self.pooled = []  # drawn with the versions rolled back
        self._write(version, self.soft, history=self.history, optim={})
        self.version = version

    def restore_version(self, version: int, *, reason: str) -> None:
        """Serve ``version`` again (its tensor and optimizer moments) as a new version; the history says why."""
        with self.files.lock():
            memory, optim = self.files.read(version)
            new = self.files.current_version()
            new = (new if new is not None else self.version) + 1
            self.history.append({"version": new, "rollback_to": version, "reasons": [reason]})
            self.pooled = []
            with torch.no_grad():
                self.soft.copy_(memory.soft_prompt.to(torch.float32))
            self.optim = torch.optim.AdamW([self.soft], lr=self.cfg.learning_rate, weight_decay=0.0)
            if optim:
                self.optim.state[self.soft] = {k: v.clone() for k, v in optim.items()}
            self._write(new, self.soft, history=self.history, optim=optim)
            self.version = new

    def summary(self) -> dict[str, Any]:
        """Version, updates, rollbacks and distance from the init (for listings and records)."""
        applied = [h for h in self.history if "label" in h]
        rollbacks = [h for h in self.history if h.get("rollback_to") is not None]
        moved = float((self.soft.detach() - self.init).norm() / self.init.norm().clamp(min=1e-12))
        return {
            "namespace": self.namespace,
            "version": self.version,
            "updates": len(applied),
            "rollbacks": [
                {"version": h["version"], "to": h["rollback_to"], "reasons": h["reasons"]} for h in rollbacks
            ],
            "moved": round(moved, 6),
        }

    def write_summary(self, path: str | Path) -> None:
        write_bytes_atomic(path, json.dumps(self.summary(), indent=2).encode())


def _trained_on(item: _Pooled) -> dict[str, Any]:
    """What the history keeps of one question an update learned from."""
    return {
        "question": item.question[:HISTORY_QUESTION_CHARS],
        "question_hash": question_hash(item.question),
        "label": item.label,
        "label_share": round(item.share, 4),
    }
