"""The TRL engine: the same memory training through TRL's ``GRPOTrainer`` and a PEFT
``PromptTuningConfig`` (the paper's implementation), kept for parity with the native loop.

Same soft-prompt initialisation (copied into PEFT's prompt encoder), the same
majority-vote reward, ``loss_type``, beta, G, S, temperature and lengths. Two
differences are inherent to TRL + PEFT and documented rather than hidden:

- the KL reference is the base model with the adapter disabled, i.e. *no* soft prompt
  (native: ``training.reference_policy: base_model`` reproduces this);
- PEFT prompt tuning always puts the soft prompt first (``prompt.soft_prompt_position: prefix``).

The shared frozen model is wrapped, not copied; after training the wrapper is dropped
and the model is put back in eval mode with gradients off.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elm_memory.config import TrainingConfig
from elm_memory.errors import ConfigError, NonFiniteError, TrainingError
from elm_memory.memory import TrainingStats
from elm_memory.models.loading import LoadedModel
from elm_memory.training.native import StepCallback, TrainResult
from elm_memory.training.rewards import majority_vote_rewards


class TRLTrainer:
    """Trains soft prompts with TRL's ``GRPOTrainer`` on a PEFT prompt-tuning wrapper of the shared model."""

    engine = "trl"

    def __init__(self, loaded: LoadedModel, cfg: TrainingConfig, *, fastest: bool = True):
        self.loaded = loaded
        self.cfg = cfg
        self.temperature = cfg.effective_temperature(loaded.info.model_type)
        # TRL defaults gradient_checkpointing to True, ~4x slower here; `fastest` turns it off.
        self.fastest = fastest

    def train_many(
        self,
        prompts: Sequence[tuple[Sequence[int], torch.Tensor, int]],
        *,
        objective: str | None = None,
        progress: bool | None = None,
        on_step: StepCallback | None = None,
    ) -> list[TrainResult]:
        """One memory at a time: TRL's GRPOTrainer owns its loop, so the memories are not batched (and
        ``on_step`` is never called; ``progress`` shows TRL's own bar)."""
        return [self.train(ids, init, at=at, objective=objective, progress=progress) for ids, init, at in prompts]

    def train(
        self,
        prompt_ids: Sequence[int],
        init: torch.Tensor,
        *,
        at: int = 0,
        objective: str | None = None,
        progress: bool | None = None,
    ) -> TrainResult:
        _require_trl()
        cfg = self.cfg
        if (objective or cfg.objective) != "grpo":
            raise ConfigError("training.objective=sft is only available with training.engine=native")
        if at != 0:
            raise ConfigError("training.engine=trl (PEFT prompt tuning) needs prompt.soft_prompt_position=prefix")
        if cfg.steps == 0:
            return TrainResult(init.detach().float().clone(), TrainingStats(engine=self.engine))

        model = self.loaded.model
        t_start = time.perf_counter()
        stats = TrainingStats(engine=self.engine, objective="grpo")
        prompt_text = self._prompt_text(prompt_ids)
        peft_model = self._prompt_tuned(init)
        try:
            with tempfile.TemporaryDirectory(prefix="elm-trl-") as out_dir:
                self._run_grpo(peft_model, prompt_text, stats, out_dir, progress)
            soft = peft_model.get_prompt_embedding_to_save("default").to(torch.float32).clone()
        finally:
            # Drop the PEFT wrapper: prompt tuning injects no layers, the base weights are untouched.
            model.eval()
            model.requires_grad_(False)
            model.config.use_cache = True
        if not torch.isfinite(soft).all():
            raise NonFiniteError("soft prompt became non-finite under TRL; memory aborted")
        stats.steps = cfg.steps
        stats.no_consensus = not any(a is not None for group in stats.answers for a in group)
        stats.seconds = time.perf_counter() - t_start
        return TrainResult(soft_prompt=soft, stats=stats)

    # -- the steps of train ----------------------------------------------------------
    def _prompt_text(self, prompt_ids: Sequence[int]) -> str:
        return trl_prompt_text(self.loaded.tokenizer, prompt_ids)

    def _prompt_tuned(self, init: torch.Tensor) -> Any:
        """The shared model wrapped in PEFT prompt tuning, its virtual tokens set to ``init``."""
        from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model

        peft_cfg = PromptTuningConfig(
            task_type=TaskType.CAUSAL_LM,
            num_virtual_tokens=init.shape[0],
            prompt_tuning_init=PromptTuningInit.RANDOM,  # overwritten with our init below: same start as native
        )
        peft_model: Any = get_peft_model(self.loaded.model, peft_cfg)
        with torch.no_grad():
            emb = peft_model.prompt_encoder["default"].embedding.weight
            emb.copy_(init.to(emb.dtype))
        return peft_model

    def _run_grpo(
        self, peft_model: Any, prompt_text: str, stats: TrainingStats, out_dir: str, progress: bool | None
    ) -> None:
        """``cfg.steps`` GRPO steps on the one prompt; rewards and losses land in ``stats``."""
        from datasets import Dataset
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOTrainer

        cfg = self.cfg
        trainer = GRPOTrainer(
            model=peft_model,
            reward_funcs=[_majority_reward(stats, cfg.num_generations)],
            args=self._grpo_config(out_dir, progress),
            train_dataset=Dataset.from_list([{"prompt": prompt_text}] * cfg.steps),
            processing_class=self.loaded.tokenizer,
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
        if not progress:
            trainer.remove_callback(ProgressCallback)
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                stats.loss.append(float(entry["loss"]))
                stats.kl.append(float(entry.get("kl", 0.0)))
                stats.completion_tokens += int(entry.get("completions/mean_length", 0) * cfg.num_generations)

    def _grpo_config(self, out_dir: str, progress: bool | None) -> Any:
        """TRL's settings for the native loop's: one question per step, constant LR, no extras."""
        from trl import GRPOConfig

        cfg, info = self.cfg, self.loaded.info
        on_cpu = info.device == "cpu"
        return GRPOConfig(
            output_dir=out_dir,
            max_steps=cfg.steps,
            per_device_train_batch_size=cfg.num_generations,  # one question per step
            num_generations=cfg.num_generations,
            max_completion_length=cfg.max_completion_length,
            temperature=self.temperature,
            top_p=cfg.top_p,
            top_k=0,
            learning_rate=cfg.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
            optim="adamw_torch" if on_cpu else "adamw_torch_fused",
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            scale_rewards="group" if cfg.scale_rewards else "none",
            num_iterations=1,
            gradient_checkpointing=not self.fastest,
            bf16=info.dtype == "bfloat16" and not on_cpu,
            use_cpu=on_cpu,
            seed=cfg.seed if cfg.seed is not None else 0,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=not progress,
            shuffle_dataset=False,
            dataloader_num_workers=0,
        )


def trl_prompt_text(tokenizer: Any, prompt_ids: Sequence[int]) -> str:
    """A prompt as text (TRL takes text), refused unless it tokenises back to the same ids: TRL must train
    on exactly the prompt the library answers from."""
    prompt_text: str = tokenizer.decode(list(prompt_ids))
    if tokenizer(prompt_text)["input_ids"] != list(prompt_ids):
        raise TrainingError("TRL would tokenise the prompt differently from the native engine; refusing")
    return prompt_text


def _require_trl() -> None:
    """Fail early, with the extra to install, when the names the engine uses are missing."""
    try:
        from datasets import Dataset  # noqa: F401
        from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"training.engine=trl needs the 'trl' extra (pip install 'elm-memory[trl]'): {exc}") from None


def _majority_reward(stats: TrainingStats, group_size: int) -> Callable[..., list[float | None]]:
    """TRL reward function: the TTRL majority-vote reward per group, recorded in ``stats`` as the native loop does."""

    def majority_reward(completions: list[str], **_: object) -> list[float | None]:
        rewards: list[float | None] = []  # TRL's reward type: None would mean "no reward for this one"
        for start in range(0, len(completions), group_size):  # TRL passes whole groups, G at a time
            group = majority_vote_rewards(completions[start : start + group_size])
            stats.answers.append(group.answers)
            stats.mean_reward.append(sum(group.rewards) / len(group.rewards))
            stats.skipped_backward.append(group.uniform)
            stats.majority_answer, stats.majority_share = group.vote.answer, group.vote.share
            rewards.extend(group.rewards)
        return rewards

    return majority_reward
