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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from elm_memory.backends.base import GenerationBackend, PromptInput, SamplingParams
from elm_memory.config import TrainingConfig
from elm_memory.errors import NonFiniteError
from elm_memory.memory import TrainingStats
from elm_memory.models.loading import LoadedModel
from elm_memory.training.losses import advantages_from_rewards, policy_loss, sft_loss
from elm_memory.training.rewards import GroupReward, majority_vote_rewards


@dataclass
class TrainResult:
    soft_prompt: torch.Tensor  # (k, hidden) float32, CPU
    stats: TrainingStats


class NativeTrainer:
    """Trains soft prompts: one (:meth:`train`) or several together (:meth:`train_many`).
    Stateless between calls; safe to reuse."""

    engine = "native"

    def __init__(self, loaded: LoadedModel, backend: GenerationBackend, cfg: TrainingConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.backend = backend
        self.cfg = cfg
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
        if rows is None:
            prompt_ids, soft_prompt, at = [prompt_ids], [soft_prompt], [at]  # type: ignore[list-item]
            rows = [0] * len(completions)
        model = self.model
        device = next(model.parameters()).device
        embed = model.get_input_embeddings()
        composed: dict[int, torch.Tensor] = {}
        for p in dict.fromkeys(rows):  # each prompt embedded once, however many rows it has
            tok = embed(torch.tensor(list(prompt_ids[p]), dtype=torch.long, device=device))
            soft = soft_prompt[p].to(device=device, dtype=tok.dtype)  # type: ignore[union-attr]
            composed[p] = torch.cat([tok[: at[p]], soft, tok[at[p] :]], dim=0)  # type: ignore[index]
        B = len(completions)
        P = max(e.shape[0] for e in composed.values())
        T = max(1, max(len(c) for c in completions))
        comp = torch.full((B, T), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(B, T, dtype=torch.long, device=device)
        for i, c in enumerate(completions):
            comp[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, : len(c)] = 1
        hidden = next(iter(composed.values())).shape[1]
        if self.cfg.share_prompt_kv:
            logits = self._logits_shared_prompt(composed, rows, comp, mask, hidden)
        else:
            logits = self._logits_full_rows(composed, rows, comp, mask, P, hidden)
        out = []
        for i in range(B):  # one row at a time keeps the fp32 copy of (T, vocab) small
            row = logits[i].float() / self.temperature
            out.append(row.gather(1, comp[i].unsqueeze(1)).squeeze(1) - torch.logsumexp(row, dim=-1))
        return torch.stack(out), mask

    def _logits_full_rows(
        self, composed: dict[int, torch.Tensor], rows: Sequence[int], comp: torch.Tensor, mask: torch.Tensor,
        P: int, hidden: int,
    ) -> torch.Tensor:  # fmt: skip
        """(B, T, vocab) logits for the completion tokens, each row carrying its own copy of its prompt."""
        T = comp.shape[1]
        embed = self.model.get_input_embeddings()
        # Prompts are left-padded to a common length P, completions right-padded: every completion
        # starts at column P, so one `logits_to_keep` serves all rows. Position ids count real tokens
        # only, so each row sees exactly the positions it has alone (right pads are harmless for a
        # causal model: real tokens never attend to the pads after them).
        prompt_emb, prompt_mask = _left_padded(composed, rows, P, hidden)
        full = torch.cat([prompt_emb, embed(comp)], dim=1)
        attn = torch.cat([prompt_mask, mask], dim=1)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            inputs_embeds=full, attention_mask=attn, position_ids=position_ids, logits_to_keep=T + 1, use_cache=False
        ).logits
        return logits[:, :T, :]

    def _logits_shared_prompt(
        self, composed: dict[int, torch.Tensor], rows: Sequence[int], comp: torch.Tensor, mask: torch.Tensor,
        hidden: int,
    ) -> torch.Tensor:  # fmt: skip
        """As :meth:`_logits_full_rows`, but each prompt goes through the model once and its KV cache is
        repeated for its rows (``training.share_prompt_kv``): G rollouts of a memory cost one prompt
        forward/backward instead of G. Gradients reach the soft prompt through the cached keys/values."""
        from transformers import DynamicCache

        B, T = comp.shape
        device = comp.device
        embed = self.model.get_input_embeddings()
        order = list(composed)  # the distinct prompts, each once
        P = max(e.shape[0] for e in composed.values())
        lengths = torch.tensor([composed[p].shape[0] for p in order], device=device)
        prompt_emb, prompt_mask = _left_padded(composed, order, P, hidden)
        cache = DynamicCache()
        out = self.model(
            inputs_embeds=prompt_emb, attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        index = {p: u for u, p in enumerate(order)}
        which = torch.tensor([index[p] for p in rows], device=device)
        cache.batch_select_indices(which)  # row i now holds its prompt's keys/values (differentiable)
        first = out.logits[:, -1, :][which]  # predicts each completion's first token
        attn = torch.cat([prompt_mask[which], mask], dim=1)
        positions = lengths[which].unsqueeze(1) + torch.arange(T, device=device).unsqueeze(0)
        rest = self.model(
            inputs_embeds=embed(comp), attention_mask=attn, position_ids=positions, past_key_values=cache,
            use_cache=True, logits_to_keep=T,
        ).logits  # fmt: skip
        return torch.cat([first.unsqueeze(1), rest[:, : T - 1, :]], dim=1)

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
            init = init[:0] if rows is None else [t[:0] for t in init]  # type: ignore[union-attr,index]
        elif current is not None:
            return current.detach()
        return self.completion_logps(prompt_ids, init, at, completions, rows=rows)[0].detach()

    # -- training --------------------------------------------------------------------
    def train(
        self,
        prompt_ids: Sequence[int],
        init: torch.Tensor,
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
        prompts: Sequence[tuple[Sequence[int], torch.Tensor, int]],
        *,
        objective: str | None = None,
        progress: bool | None = None,
    ) -> list[TrainResult]:
        """Train M memories together, one per ``(prompt_ids, init, at)``; results in the same order.

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
        mems = [_Memory.start(ids, init, at, cfg, self.engine, objective) for ids, init, at in prompts]
        if not mems:
            return []
        M = len(mems)
        desc = "learning memory" if M == 1 else f"learning {M} memories"
        bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=_disable(progress), leave=False)
        for step in bar:
            # 1. rollouts (or the SFT targets, generated once), one backend call for all memories
            t0 = time.perf_counter()
            completions: list[list[list[int]]] = []
            groups: list[GroupReward | None] = []
            if objective == "sft":
                if step == 0:
                    for m, (target, answer) in zip(mems, self._greedy_targets([m.prompt_ids for m in mems])):
                        m.sft_target = target
                        m.stats.majority_answer, m.stats.majority_share = answer, 1.0 if answer is not None else 0.0
                        m.saw_answer = answer is not None
                completions = [[m.sft_target or []] for m in mems]
                groups = [None] * M
            else:
                # copies: the optimizers update the soft prompts in place, rollout inputs must not change under them
                batch = [(m.prompt_ids, m.soft.detach().clone(), m.at) for m in mems]
                for m, rollouts in zip(mems, self._rollouts_many(batch, seed=_step_seed(cfg.seed, step))):
                    group = majority_vote_rewards([g.text for g in rollouts])
                    comps = [g.token_ids for g in rollouts]
                    completions.append(comps)
                    groups.append(group)
                    m.saw_answer = m.saw_answer or any(a is not None for a in group.answers)
                    m.stats.answers.append(group.answers)
                    m.stats.mean_reward.append(sum(group.rewards) / len(group.rewards))
                    m.stats.majority_answer, m.stats.majority_share = group.vote.answer, group.vote.share
                    m.stats.completion_tokens += sum(len(c) for c in comps)
            gen_seconds = time.perf_counter() - t0

            # 2. a memory whose rewards are all equal skips its own backward (its optimizer is not stepped)
            t1 = time.perf_counter()
            active = []
            for i, (m, group) in enumerate(zip(mems, groups)):
                m.stats.generation_seconds += gen_seconds
                if group is not None and cfg.skip_uniform_rewards and group.uniform:
                    m.stats.skipped_backward.append(True)
                    m.stats.loss.append(0.0)
                    m.stats.kl.append(m.stats.kl[-1] if m.stats.kl else 0.0)
                    m.stats.steps += 1
                else:
                    active.append(i)

            # 3. one loss over the active memories' rows, then a per-memory clip and update
            if active:
                for i in active:
                    mems[i].optim.zero_grad(set_to_none=True)
                losses, kls = self._backward(mems, active, completions, groups, step, objective)
                for i in active:
                    m = mems[i]
                    if cfg.max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_([m.soft], cfg.max_grad_norm)  # per memory, never global
                    m.optim.step()
                    if not torch.isfinite(m.soft).all():
                        raise NonFiniteError(
                            f"{_which(i, M)}soft prompt became non-finite at step {step + 1}; memory aborted"
                        )
                bwd_seconds = time.perf_counter() - t1
                for i in active:
                    s = mems[i].stats
                    s.backward_seconds += bwd_seconds
                    s.skipped_backward.append(False)
                    s.loss.append(losses[i])
                    s.kl.append(kls[i])
                    s.steps += 1
            bar.set_postfix(_postfix(mems, active))
        bar.close()
        seconds = time.perf_counter() - t_start
        results = []
        for m in mems:
            m.stats.no_consensus = not m.saw_answer if cfg.steps > 0 else False
            m.stats.seconds = seconds
            results.append(TrainResult(soft_prompt=m.soft.detach().to("cpu", torch.float32).clone(), stats=m.stats))
        return results

    def _backward(
        self,
        mems: list[_Memory],
        active: list[int],
        completions: list[list[list[int]]],
        groups: list[GroupReward | None],
        step: int,
        objective: str,
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Backward of sum over active memories of each memory's own loss; (loss, mean KL) per memory.

        Each loss depends only on its memory's rows, so each soft prompt's gradient is the one
        it would get alone. Micro-batches (``micro_batch_size`` rows, across memories) accumulate.
        """
        cfg = self.cfg
        rows = [(i, j) for i in active for j in range(len(completions[i]))]
        # default: one group's worth of rows per forward, so M memories cost M x the activations of one only in time
        micro = cfg.micro_batch_size or cfg.num_generations
        adv: dict[int, torch.Tensor] = {}
        group_tokens = {i: sum(len(c) for c in completions[i]) for i in active}
        for i in active:
            group = groups[i]
            if group is not None:
                adv[i] = advantages_from_rewards(torch.tensor(group.rewards, dtype=torch.float32), cfg.scale_rewards)
        all_ids = [m.prompt_ids for m in mems]
        all_at = [m.at for m in mems]
        loss_sum = dict.fromkeys(active, 0.0)
        kl_sum = dict.fromkeys(active, 0.0)
        kl_tokens = dict.fromkeys(active, 0)
        for start in range(0, len(rows), micro):
            chunk = rows[start : start + micro]
            owner = [i for i, _ in chunk]
            comps = [completions[i][j] for i, j in chunk]
            logps, mask = self.completion_logps(all_ids, [m.soft for m in mems], all_at, comps, rows=owner)
            ref = None
            if objective != "sft" and cfg.beta != 0.0:
                with torch.no_grad():
                    ref = self.reference_logps(all_ids, [m.init for m in mems], all_at, comps,
                                               logps if step == 0 else None, rows=owner)  # fmt: skip
            total: torch.Tensor | None = None
            for i in dict.fromkeys(owner):
                sel = torch.tensor([r for r, o in enumerate(owner) if o == i], device=logps.device)
                js = [j for o, j in chunk if o == i]
                if objective == "sft":
                    loss = sft_loss(logps[sel], mask[sel]) * (len(js) / len(completions[i]))
                    kl = torch.zeros(())
                else:
                    loss, kl = policy_loss(
                        logps[sel], None if ref is None else ref[sel], adv[i][js].to(logps.device), mask[sel],
                        beta=cfg.beta, loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                        group_size=len(completions[i]), group_tokens=group_tokens[i],
                    )  # fmt: skip
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

    def _rollouts_many(
        self, prompts: Sequence[tuple[Sequence[int], torch.Tensor, int]], seed: int | None
    ) -> list[list[Any]]:
        """G rollouts per prompt in one backend call. Every prompt carries ``seed`` itself, so its
        rollouts are those it would get alone, whatever else is in the call."""
        cfg = self.cfg
        params = SamplingParams(
            max_new_tokens=cfg.max_completion_length,
            temperature=self.temperature,
            top_p=cfg.top_p,
            n=cfg.num_generations,
            seed=seed,
            stop_at_answer=cfg.stop_at_answer,
        )
        inputs = [PromptInput(tuple(ids), soft_prompt=soft, soft_prompt_at=at, seed=seed) for ids, soft, at in prompts]
        return self.backend.generate(inputs, params)

    def _rollouts(self, prompt_ids: Sequence[int], soft: torch.Tensor, at: int, seed: int | None) -> list[Any]:
        [group] = self._rollouts_many([(prompt_ids, soft, at)], seed)
        return group

    def _greedy_targets(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], str | None]]:
        from elm_memory.answers import extract_answer

        params = SamplingParams(max_new_tokens=self.cfg.max_completion_length, stop_at_answer=self.cfg.stop_at_answer)
        gens = self.backend.generate([PromptInput(tuple(ids)) for ids in prompts], params)
        return [(g.token_ids, extract_answer(g.text)) for [g] in gens]

    def _greedy_target(self, prompt_ids: Sequence[int]) -> tuple[list[int], str | None]:
        [target] = self._greedy_targets([prompt_ids])
        return target


@dataclass
class _Memory:
    """One memory's training state inside :meth:`NativeTrainer.train_many`."""

    prompt_ids: list[int]
    at: int
    init: torch.Tensor
    soft: torch.nn.Parameter
    optim: torch.optim.Optimizer
    stats: TrainingStats
    sft_target: list[int] | None = None
    saw_answer: bool = False

    @classmethod
    def start(
        cls, prompt_ids: Sequence[int], init: torch.Tensor, at: int, cfg: TrainingConfig, engine: str, objective: str
    ) -> _Memory:
        init = init.detach().to(torch.float32)
        soft = torch.nn.Parameter(init.clone())
        # One AdamW per memory: its step count and moments move only when this memory updates.
        optim = torch.optim.AdamW([soft], lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        stats = TrainingStats(engine=engine, objective=objective)
        return cls(list(prompt_ids), at, init, soft, optim, stats)


def _which(i: int, m: int) -> str:
    return "" if m == 1 else f"memory {i + 1}/{m}: "


def _postfix(mems: list[_Memory], active: list[int]) -> dict[str, str]:
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


def _left_padded(
    composed: dict[int, torch.Tensor], keys: Sequence[int], width: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(len(keys), width, hidden) prompt embeddings ``composed[k]``, left-padded with zeros, and their mask."""
    emb = torch.stack(
        [torch.cat([composed[k].new_zeros(width - composed[k].shape[0], hidden), composed[k]]) for k in keys]
    )
    lengths = torch.tensor([composed[k].shape[0] for k in keys], device=emb.device)
    mask = (torch.arange(width, device=emb.device).unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
    return emb, mask


def _step_seed(seed: int | None, step: int) -> int | None:
    return None if seed is None else seed + step


def _disable(progress: bool | None) -> bool | None:
    # None: tqdm shows the bar only on a terminal.
    return None if progress is None else not progress
