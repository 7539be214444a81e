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
    """Trains one soft prompt for one prompt. Stateless between calls; safe to reuse."""

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
        prompt_ids: Sequence[int],
        soft_prompt: torch.Tensor,
        at: int,
        completions: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs of each completion token under [prompt with soft prompt at ``at``], and the mask.

        Log-probs are of the temperature-scaled distribution the rollouts were sampled from
        (as TRL computes them). Gradients flow into ``soft_prompt`` when it requires grad.
        """
        model = self.model
        device = next(model.parameters()).device
        embed = model.get_input_embeddings()
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
        tok = embed(ids)
        soft = soft_prompt.to(device=device, dtype=tok.dtype)
        prompt_emb = torch.cat([tok[:at], soft, tok[at:]], dim=0)
        B = len(completions)
        T = max(1, max(len(c) for c in completions))
        comp = torch.full((B, T), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(B, T, dtype=torch.long, device=device)
        for i, c in enumerate(completions):
            comp[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, : len(c)] = 1
        full = torch.cat([prompt_emb.unsqueeze(0).expand(B, -1, -1), embed(comp)], dim=1)
        attn = torch.cat([torch.ones(B, prompt_emb.shape[0], dtype=torch.long, device=device), mask], dim=1)
        # Right padding is safe for a causal model: real tokens never attend to the pads after them.
        logits = model(inputs_embeds=full, attention_mask=attn, logits_to_keep=T + 1, use_cache=False).logits
        logits = logits[:, :T, :]
        rows = []
        for i in range(B):  # one row at a time keeps the fp32 copy of (T, vocab) small
            row = logits[i].float() / self.temperature
            rows.append(row.gather(1, comp[i].unsqueeze(1)).squeeze(1) - torch.logsumexp(row, dim=-1))
        return torch.stack(rows), mask

    def reference_logps(
        self,
        prompt_ids: Sequence[int],
        init: torch.Tensor,
        at: int,
        completions: Sequence[Sequence[int]],
        current: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-probs under the reference policy (frozen model + initial soft prompt, or no soft prompt).

        ``current``: the policy's log-probs before any update, which *are* the initial-prompt
        reference, so the extra forward is skipped at step 0.
        """
        if self.cfg.reference_policy == "base_model":
            init = init[:0]  # no soft prompt at all
        elif current is not None:
            return current.detach()
        return self.completion_logps(prompt_ids, init, at, completions)[0].detach()

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
        cfg = self.cfg
        objective = objective or cfg.objective
        t_start = time.perf_counter()
        stats = TrainingStats(engine=self.engine, objective=objective)
        init = init.detach().to(torch.float32)
        soft = torch.nn.Parameter(init.clone())
        optim = torch.optim.AdamW([soft], lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        sft_target: list[int] | None = None
        saw_answer = False

        bar = tqdm(range(cfg.steps), desc="learning memory", unit="step", disable=_disable(progress), leave=False)
        for step in bar:
            # 1. rollouts (or the SFT target, generated once)
            t0 = time.perf_counter()
            if objective == "sft":
                if sft_target is None:
                    sft_target, answer = self._greedy_target(prompt_ids)
                    stats.majority_answer, stats.majority_share = answer, 1.0 if answer is not None else 0.0
                    saw_answer = answer is not None
                completions = [sft_target]
                group: GroupReward | None = None
            else:
                # a copy: the optimizer updates `soft` in place, the rollout input must not change under it
                rollouts = self._rollouts(prompt_ids, soft.detach().clone(), at, seed=_step_seed(cfg.seed, step))
                completions = [g.token_ids for g in rollouts]
                group = majority_vote_rewards([g.text for g in rollouts])
                saw_answer = saw_answer or any(a is not None for a in group.answers)
                stats.answers.append(group.answers)
                stats.mean_reward.append(sum(group.rewards) / len(group.rewards))
                stats.majority_answer, stats.majority_share = group.vote.answer, group.vote.share
                stats.completion_tokens += sum(len(c) for c in completions)
            stats.generation_seconds += time.perf_counter() - t0

            # 2. skip the backward when it cannot change anything
            t1 = time.perf_counter()
            if group is not None and cfg.skip_uniform_rewards and group.uniform:
                stats.skipped_backward.append(True)
                stats.loss.append(0.0)
                stats.kl.append(stats.kl[-1] if stats.kl else 0.0)
                stats.steps += 1
                bar.set_postfix(reward=f"{stats.mean_reward[-1]:.2f}", skip="uniform")
                continue

            # 3. loss and update
            optim.zero_grad(set_to_none=True)
            loss_value, kl_value = self._backward(prompt_ids, soft, init, at, completions, group, step, objective)
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([soft], cfg.max_grad_norm)
            optim.step()
            if not torch.isfinite(soft).all():
                raise NonFiniteError(f"soft prompt became non-finite at step {step + 1}; memory aborted")
            stats.backward_seconds += time.perf_counter() - t1
            stats.skipped_backward.append(False)
            stats.loss.append(loss_value)
            stats.kl.append(kl_value)
            stats.steps += 1
            postfix = {"loss": f"{loss_value:.4f}", "kl": f"{kl_value:.2e}"}
            if stats.mean_reward:
                postfix["reward"] = f"{stats.mean_reward[-1]:.2f}"
            bar.set_postfix(postfix)
        bar.close()
        stats.no_consensus = not saw_answer if cfg.steps > 0 else False
        stats.seconds = time.perf_counter() - t_start
        return TrainResult(soft_prompt=soft.detach().to("cpu", torch.float32).clone(), stats=stats)

    def _backward(
        self,
        prompt_ids: Sequence[int],
        soft: torch.nn.Parameter,
        init: torch.Tensor,
        at: int,
        completions: list[list[int]],
        group: GroupReward | None,
        step: int,
        objective: str,
    ) -> tuple[float, float]:
        cfg = self.cfg
        micro = cfg.micro_batch_size or len(completions)
        total_loss, kl_sum, kl_rows = 0.0, 0.0, 0
        group_tokens = sum(len(c) for c in completions)
        adv = None
        if group is not None:
            adv = advantages_from_rewards(torch.tensor(group.rewards, dtype=torch.float32), cfg.scale_rewards)
        for start in range(0, len(completions), micro):
            chunk = completions[start : start + micro]
            logps, mask = self.completion_logps(prompt_ids, soft, at, chunk)
            if objective == "sft":
                loss = sft_loss(logps, mask) * (len(chunk) / len(completions))
                kl = torch.zeros(())
            else:
                ref = None
                if cfg.beta != 0.0:
                    with torch.no_grad():
                        ref = self.reference_logps(prompt_ids, init, at, chunk, logps if step == 0 else None)
                loss, kl = policy_loss(
                    logps, ref, adv[start : start + micro], mask,
                    beta=cfg.beta, loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                    group_size=len(completions), group_tokens=group_tokens,
                )  # fmt: skip
            if not torch.isfinite(loss):
                raise NonFiniteError(f"loss is {loss.item()} at step {step + 1}; memory aborted")
            loss.backward()
            total_loss += loss.item()
            kl_sum += kl.item() * len(chunk)
            kl_rows += len(chunk)
        return total_loss, kl_sum / max(1, kl_rows)

    def _rollouts(self, prompt_ids: Sequence[int], soft: torch.Tensor, at: int, seed: int | None) -> list[Any]:
        cfg = self.cfg
        params = SamplingParams(
            max_new_tokens=cfg.max_completion_length,
            temperature=self.temperature,
            top_p=cfg.top_p,
            n=cfg.num_generations,
            seed=seed,
            stop_at_answer=cfg.stop_at_answer,
        )
        [group] = self.backend.generate([PromptInput(tuple(prompt_ids), soft_prompt=soft, soft_prompt_at=at)], params)
        return group

    def _greedy_target(self, prompt_ids: Sequence[int]) -> tuple[list[int], str | None]:
        from elm_memory.answers import extract_answer

        params = SamplingParams(max_new_tokens=self.cfg.max_completion_length, stop_at_answer=self.cfg.stop_at_answer)
        [[g]] = self.backend.generate([PromptInput(tuple(prompt_ids))], params)
        return g.token_ids, extract_answer(g.text)


def _step_seed(seed: int | None, step: int) -> int | None:
    return None if seed is None else seed + step


def _disable(progress: bool | None) -> bool | None:
    # None: tqdm shows the bar only on a terminal.
    return None if progress is None else not progress
