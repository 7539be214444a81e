"""The native memory-training loop: GRPO (or SFT) on a soft prompt, base model frozen.

One step:
  1. G rollouts of the templated prompt with the *current* soft prompt, from the
     generation backend (transformers or vLLM: the base model is frozen, so a changed
     soft prompt needs no weight sync, only new input embeddings);
  2. TTRL rewards from the group's majority answer;
  3. if all rewards are equal the advantage is zero for everyone: skip the backward
     (``skip_uniform_rewards``), keep the stats;
  4. one forward with the soft prompt in the graph (logits only for completion positions),
     reference log-probs from the *initial* soft prompt under ``no_grad`` (no second model),
     Dr.GRPO loss, backward, clip, AdamW on the soft prompt only.

Several memories train together (:meth:`NativeTrainer.train_many`): one backend call for
all M x G rollouts, one forward/backward whose rows carry their own memory's soft prompt,
and per memory everything else (optimizer, clipping, loss normaliser, skip, stats).

``lora`` and ``prefix`` memories (:mod:`elm_memory.memory`; an adapter as the ``init`` of a
``train_many`` item) go through the same loop: rollouts under a snapshot of the adapter, the same
rewards, skip and Dr.GRPO loss, AdamW on the adapter's tensors only. Their forwards cannot mix
memories (a hook or prefix cache serves a whole forward), so their micro-batches never cross
memories and the backend decodes each memory's rollouts as its own batch. KL reference: the
initial memory, as for soft prompts; for ``lora`` that is the base model (B = 0), so its
reference forward runs without the adapter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from tqdm.auto import tqdm

from elm_memory.backends.base import Generation, GenerationBackend, PromptInput, SamplingParams
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import MemoryConfig, TrainingConfig
from elm_memory.errors import NonFiniteError
from elm_memory.memory.kinds import LORA, MemoryAdapter
from elm_memory.models.loading import LoadedModel
from elm_memory.training.losses import advantages_from_rewards, policy_loss, sft_loss
from elm_memory.training.native_state import MemoryRun, StepBatch, TrainResult
from elm_memory.training.rewards import GroupReward, majority_vote_rewards

#: ``on_step(done, steps)``: called after each training step of a ``train_many`` call, for progress
#: displays (an engine that owns its loop, as TRL's, may never call it)
StepCallback = Callable[[int, int], None]


class NativeTrainer:
    """Trains soft prompts: one (:meth:`train`) or several together (:meth:`train_many`).
    Stateless between calls; safe to reuse."""

    engine = "native"

    def __init__(
        self, loaded: LoadedModel, backend: GenerationBackend, cfg: TrainingConfig, memory: MemoryConfig | None = None
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.backend = backend
        self.cfg = cfg
        self.memory_cfg = memory
        self.temperature = cfg.effective_temperature(loaded.info.model_type)
        self.pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0

    # -- log-probabilities -----------------------------------------------------------
    def completion_logps(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        soft_prompt: torch.Tensor | Sequence[torch.Tensor],
        at: int | Sequence[int],
        completions: Sequence[Sequence[int]],
        *,
        rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs of each completion token under [prompt with soft prompt at ``at``], and the mask.

        Without ``rows`` every completion is scored under the one prompt given. With ``rows``
        (several memories in one forward), ``prompt_ids``, ``soft_prompt`` and ``at`` hold one
        entry per prompt and completion ``i`` is scored under prompt ``rows[i]``.

        Log-probs are of the temperature-scaled distribution the rollouts were sampled from
        (as TRL computes them). Gradients flow into each soft prompt that requires grad, and only
        from the rows of its own prompt.
        """
        one = rows is None  # one prompt, given bare
        all_ids = cast(Sequence[Sequence[int]], [prompt_ids] if one else prompt_ids)
        softs = cast(Sequence[torch.Tensor], [soft_prompt] if one else soft_prompt)
        ats = cast(Sequence[int], [at] if one else at)
        prompts = [
            PromptInput(tuple(ids), soft_prompt=soft, soft_prompt_at=pos)
            for ids, soft, pos in zip(all_ids, softs, ats, strict=True)
        ]
        return completion_logprobs(
            self.model,
            prompts,
            completions,
            rows=rows,
            temperature=self.temperature,
            share_prompt_kv=self.cfg.share_prompt_kv,
            pad_id=self.pad_id,
        )

    def reference_logps(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        init: torch.Tensor | Sequence[torch.Tensor],
        at: int | Sequence[int],
        completions: Sequence[Sequence[int]],
        current: torch.Tensor | None = None,
        *,
        rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Log-probs under the reference policy (frozen model + initial soft prompt, or no soft prompt).

        ``current``: the policy's log-probs before any update, which *are* the initial-prompt
        reference, so the extra forward is skipped at step 0. ``rows``: as in :meth:`completion_logps`.
        """
        if self.cfg.reference_policy == "base_model":
            # no soft prompt at all
            init = init[:0] if rows is None else [t[:0] for t in init]
        elif current is not None:
            return current.detach()
        return self.completion_logps(prompt_ids, init, at, completions, rows=rows)[0].detach()

    # -- training --------------------------------------------------------------------
    def train(
        self,
        prompt_ids: Sequence[int],
        init: torch.Tensor | MemoryAdapter,
        *,
        at: int = 0,
        objective: str | None = None,
        progress: bool | None = None,
    ) -> TrainResult:
        """Train one memory: :meth:`train_many` with M = 1."""
        [result] = self.train_many([(prompt_ids, init, at)], objective=objective, progress=progress)
        return result

    def train_many(
        self,
        prompts: Sequence[tuple[Sequence[int], torch.Tensor | MemoryAdapter, int]],
        *,
        objective: str | None = None,
        progress: bool | None = None,
        on_step: StepCallback | None = None,
    ) -> list[TrainResult]:
        """Train M memories together, one per ``(prompt_ids, init, at)``; results in the same order.
        ``init``: a soft prompt (k, hidden), or a lora/prefix adapter (``at`` unused).

        Each step makes one backend call for all M x G rollouts (every prompt with its own
        current soft prompt and the seed a lone run would use), then one forward/backward
        over the rows of the memories whose group has non-uniform rewards. Memories share
        no state: each has its own AdamW, its own gradient clipping, its own Dr.GRPO
        normaliser and its own stats, so each result equals the memory trained alone, to float
        rounding, provided a prompt's rollouts do not depend on its batch-mates: the ``hf``
        backend honours ``PromptInput.seed`` for that, and so do the vLLM backends (up to their own
        batch-dependent numerics).
        A non-finite loss or soft prompt in any memory aborts the whole call (NonFiniteError);
        callers that need to know which memory failed retrain them one at a time. Timings in
        the stats are the batch's.
        """
        cfg = self.cfg
        objective = objective or cfg.objective
        t_start = time.perf_counter()
        lr = (
            cfg.learning_rate if self.memory_cfg is None else self.memory_cfg.effective_learning_rate(cfg.learning_rate)
        )
        mems = [MemoryRun.start(ids, init, at, cfg, lr, self.engine, objective) for ids, init, at in prompts]
        if not mems:
            return []
        if len({m.adapter is None for m in mems}) > 1:
            raise ValueError("train_many trains soft prompts or lora/prefix memories in one call, not both")
        desc = "learning memory" if len(mems) == 1 else f"learning {len(mems)} memories"
        bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=_disable(progress), leave=False)
        for step in bar:
            t0 = time.perf_counter()
            batch = self._sft_targets(mems, step) if objective == "sft" else self._rollout_groups(mems, step)
            active = self._skip_uniform(mems, batch, time.perf_counter() - t0)
            if active:
                self._update(mems, active, batch)
            bar.set_postfix(_postfix(mems, active))
            if on_step is not None:
                on_step(step + 1, cfg.steps)
        bar.close()
        seconds = time.perf_counter() - t_start
        return [m.result(seconds, trained=cfg.steps > 0) for m in mems]

    # -- the steps of train_many ---------------------------------------------------------
    def _sft_targets(self, mems: list[MemoryRun], step: int) -> StepBatch:
        """Step 1 (SFT): each memory's greedy answer, generated once at step 0, is its one target."""
        if step == 0:
            for m, (target, answer) in zip(mems, self._greedy_targets([m.prompt_ids for m in mems]), strict=True):
                m.sft_target = target
                m.stats.majority_answer, m.stats.majority_share = answer, 1.0 if answer is not None else 0.0
                m.saw_answer = answer is not None
        return StepBatch(step, "sft", [[m.sft_target or []] for m in mems], [None] * len(mems))

    def _rollout_groups(self, mems: list[MemoryRun], step: int) -> StepBatch:
        """Step 1 (GRPO): G rollouts per memory, one backend call for all, and their TTRL rewards."""
        # copies: the optimizers update the memories in place, rollout inputs must not change under them
        inputs = [(m.prompt_ids, m.snapshot(), m.at) for m in mems]
        completions: list[list[list[int]]] = []
        groups: list[GroupReward | None] = []
        for m, rollouts in zip(mems, self._rollouts_many(inputs, seed=_step_seed(self.cfg.seed, step)), strict=True):
            group = majority_vote_rewards([g.text for g in rollouts])
            comps = [g.token_ids for g in rollouts]
            m.record_group(group, comps)
            completions.append(comps)
            groups.append(group)
        return StepBatch(step, "grpo", completions, groups)

    def _skip_uniform(self, mems: list[MemoryRun], batch: StepBatch, gen_seconds: float) -> list[int]:
        """Step 2: the memories to update. One whose rewards are all equal has zero advantage
        everywhere: it skips its backward (its optimizer is not stepped) but keeps its stats; so does one
        whose rollouts' majority share is below ``skip_below_majority_share`` (too little agreement)."""
        active = []
        for i, (m, group) in enumerate(zip(mems, batch.groups, strict=True)):
            m.stats.generation_seconds += gen_seconds
            weak = group is not None and group.vote.share < self.cfg.skip_below_majority_share
            if weak or (group is not None and self.cfg.skip_uniform_rewards and group.uniform):
                m.record_skip()
            else:
                active.append(i)
        return active

    def _update(self, mems: list[MemoryRun], active: list[int], batch: StepBatch) -> None:
        """Step 3: one loss over the active memories' rows, then a per-memory clip and AdamW step."""
        t1 = time.perf_counter()
        for i in active:
            mems[i].optim.zero_grad(set_to_none=True)
        losses, kls = self._backward(mems, active, batch)
        for i in active:
            m = mems[i]
            if self.cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.params, self.cfg.max_grad_norm)  # per memory, never global
            m.optim.step()
            if not all(torch.isfinite(t).all() for t in m.params):
                which = _which(i, len(mems))
                raise NonFiniteError(f"{which}{m.what} became non-finite at step {batch.step + 1}; memory aborted")
        seconds = time.perf_counter() - t1
        for i in active:
            mems[i].record_update(losses[i], kls[i], seconds)

    def _backward(
        self, mems: list[MemoryRun], active: list[int], batch: StepBatch
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Backward of sum over active memories of each memory's own loss; (loss, mean KL) per memory.

        Each loss depends only on its memory's rows, so each soft prompt's gradient is the one
        it would get alone. Micro-batches (``micro_batch_size`` rows, across memories) accumulate.
        """
        cfg, completions, step = self.cfg, batch.completions, batch.step
        rows = [(i, j) for i in active for j in range(len(completions[i]))]
        micro = cfg.micro_batch_size or default_micro_batch(self.model, cfg.num_generations)
        adapters = any(m.adapter is not None for m in mems)
        adv = {
            i: advantages_from_rewards(torch.tensor(group.rewards, dtype=torch.float32), cfg.scale_rewards)
            for i in active
            if (group := batch.groups[i]) is not None
        }
        group_tokens = {i: sum(len(c) for c in completions[i]) for i in active}
        all_ids, all_at = [m.prompt_ids for m in mems], [m.at for m in mems]
        loss_sum = dict.fromkeys(active, 0.0)
        kl_sum = dict.fromkeys(active, 0.0)
        kl_tokens = dict.fromkeys(active, 0)
        for chunk in _chunks(rows, micro, per_memory=adapters):
            owner = [i for i, _ in chunk]
            comps = [completions[i][j] for i, j in chunk]
            want_ref = batch.objective != "sft" and cfg.beta != 0.0
            if adapters:  # one memory per forward (see the module doc)
                logps, mask, ref = self._adapter_logps(mems[owner[0]], comps, step, want_ref)
            else:
                logps, mask = self.completion_logps(all_ids, [m.soft for m in mems], all_at, comps, rows=owner)
                ref = None
                if want_ref:
                    with torch.no_grad():
                        ref = self.reference_logps(
                            all_ids, [m.init for m in mems], all_at, comps, logps if step == 0 else None, rows=owner
                        )
            total: torch.Tensor | None = None
            for i in dict.fromkeys(owner):
                sel = torch.tensor([r for r, o in enumerate(owner) if o == i], device=logps.device)
                js = [j for o, j in chunk if o == i]
                loss, kl = self._memory_loss(
                    logps[sel],
                    None if ref is None else ref[sel],
                    mask[sel],
                    adv.get(i),
                    js,
                    len(completions[i]),
                    group_tokens[i],
                    batch.objective,
                )
                if not torch.isfinite(loss):
                    which = _which(i, len(mems))
                    raise NonFiniteError(f"{which}loss is {loss.item()} at step {step + 1}; memory aborted")
                total = loss if total is None else total + loss
                loss_sum[i] += loss.item()
                n_tokens = int(mask[sel].sum().item())
                kl_sum[i] += kl.item() * n_tokens  # policy_loss gives the token mean; keep the sum
                kl_tokens[i] += n_tokens
            assert total is not None
            total.backward()
        return loss_sum, {i: kl_sum[i] / max(1, kl_tokens[i]) for i in active}

    def _adapter_logps(
        self, m: MemoryRun, comps: list[list[int]], step: int, want_ref: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Policy log-probs (with gradients into the adapter), mask and reference log-probs of one
        lora/prefix memory's rows. Reference: the initial memory; at step 0 that is the current one, and
        for lora always the bare base model (B = 0), as with ``reference_policy: base_model``."""
        assert m.adapter is not None

        def logps_under(memory: MemoryAdapter | None) -> tuple[torch.Tensor, torch.Tensor]:
            prompt = PromptInput(tuple(m.prompt_ids), memory=memory)
            return completion_logprobs(
                self.model,
                [prompt],
                comps,
                temperature=self.temperature,
                share_prompt_kv=self.cfg.share_prompt_kv,
                pad_id=self.pad_id,
            )

        logps, mask = logps_under(m.adapter)
        if not want_ref:
            return logps, mask, None
        base = m.adapter.kind == LORA or self.cfg.reference_policy == "base_model"
        if step == 0 and (m.adapter.kind == LORA or not base):  # the current memory is still the reference
            return logps, mask, logps.detach()
        with torch.no_grad():
            ref = logps_under(None if base else m.reference)[0]
        return logps, mask, ref.detach()

    def _memory_loss(
        self,
        logps: torch.Tensor,
        ref: torch.Tensor | None,
        mask: torch.Tensor,
        adv: torch.Tensor | None,
        js: list[int],
        group_size: int,
        group_tokens: int,
        objective: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, mean KL) of one memory's rows ``js`` of its group in a micro-batch; the group-wide
        normalisers make the micro-batches' losses sum to the group's."""
        cfg = self.cfg
        if objective == "sft":
            return sft_loss(logps, mask) * (len(js) / group_size), torch.zeros(())
        assert adv is not None
        return policy_loss(
            logps,
            ref,
            adv[js].to(logps.device),
            mask,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            max_completion_length=cfg.max_completion_length,
            group_size=group_size,
            group_tokens=group_tokens,
        )

    # -- generation ------------------------------------------------------------------
    def _rollouts_many(
        self, prompts: Sequence[tuple[Sequence[int], torch.Tensor | MemoryAdapter, int]], seed: int | None
    ) -> list[list[Generation]]:
        """G rollouts per prompt in one backend call. Every prompt carries ``seed`` itself, so its
        rollouts are those it would get alone, whatever else is in the call."""
        inputs = [
            PromptInput(tuple(ids), soft_prompt=soft, soft_prompt_at=at, seed=seed)
            if isinstance(soft, torch.Tensor)
            else PromptInput(tuple(ids), seed=seed, memory=soft)
            for ids, soft, at in prompts
        ]
        return self.backend.generate(inputs, self.rollout_params(seed))

    def rollout_params(self, seed: int | None) -> SamplingParams:
        """How a training step samples its G rollouts (public: the learn-step benchmark times this call)."""
        cfg = self.cfg
        return SamplingParams(
            max_new_tokens=cfg.max_completion_length,
            temperature=self.temperature,
            top_p=cfg.top_p,
            n=cfg.num_generations,
            seed=seed,
            stop_at_answer=cfg.stop_at_answer,
        )

    def _rollouts(self, prompt_ids: Sequence[int], soft: torch.Tensor, at: int, seed: int | None) -> list[Generation]:
        [group] = self._rollouts_many([(prompt_ids, soft, at)], seed)
        return group

    def _greedy_targets(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], str | None]]:
        from elm_memory.answers import extract_answer

        params = SamplingParams(max_new_tokens=self.cfg.max_completion_length, stop_at_answer=self.cfg.stop_at_answer)
        gens = self.backend.generate([PromptInput(tuple(ids)) for ids in prompts], params)
        return [(g.token_ids, extract_answer(g.text)) for [g] in gens]


def default_micro_batch(model: torch.nn.Module, group: int) -> int:
    """Rollouts per forward/backward when ``training.micro_batch_size`` is unset.

    On a CPU, one: a batched backward holds every row's activations (eager attention's weights among
    them) at once, and the process keeps that peak, while a row of a few hundred tokens already keeps the
    matrix units fairly busy. What it costs in time is measured in docs/results/training-memory.md.
    Elsewhere, the memory's whole group, so M memories cost M x the activations of one only in time."""
    device = next(model.parameters()).device
    return 1 if device.type == "cpu" else group


def _chunks(rows: list[tuple[int, int]], micro: int, *, per_memory: bool) -> list[list[tuple[int, int]]]:
    """Micro-batches of ``micro`` rows; with ``per_memory`` none holds rows of two memories."""
    if not per_memory:
        return [rows[s : s + micro] for s in range(0, len(rows), micro)]
    by_memory: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        by_memory.setdefault(row[0], []).append(row)
    return [group[s : s + micro] for group in by_memory.values() for s in range(0, len(group), micro)]


def _which(i: int, m: int) -> str:
    return "" if m == 1 else f"memory {i + 1}/{m}: "


def _postfix(mems: list[MemoryRun], active: list[int]) -> dict[str, str]:
    """Progress-bar figures for a step: mean loss / KL over the updated memories, mean reward over all."""
    out: dict[str, str] = {}
    if active:
        out["loss"] = f"{sum(mems[i].stats.loss[-1] for i in active) / len(active):.4f}"
        out["kl"] = f"{sum(mems[i].stats.kl[-1] for i in active) / len(active):.2e}"
    rewards = [m.stats.mean_reward[-1] for m in mems if m.stats.mean_reward]
    if rewards:
        out["reward"] = f"{sum(rewards) / len(rewards):.2f}"
    if len(active) < len(mems):
        out["skip"] = "uniform" if len(mems) == 1 else f"{len(mems) - len(active)}/{len(mems)}"
    return out


def _step_seed(seed: int | None, step: int) -> int | None:
    return None if seed is None else seed + step


def _disable(progress: bool | None) -> bool | None:
    # None: tqdm shows the bar only on a terminal.
    return None if progress is None else not progress
