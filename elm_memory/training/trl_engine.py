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
from collections.abc import Sequence

import torch

from elm_memory.config import TrainingConfig
from elm_memory.errors import ConfigError, NonFiniteError, TrainingError
from elm_memory.memory import TrainingStats
from elm_memory.models.loading import LoadedModel
from elm_memory.training.native import TrainResult
from elm_memory.training.rewards import majority_vote_rewards


class TRLTrainer:
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
    ) -> list[TrainResult]:
        """One memory at a time: TRL's GRPOTrainer owns its loop, so the memories are not batched."""
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
        try:
            from datasets import Dataset
            from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model
            from trl import GRPOConfig, GRPOTrainer
        except ImportError as exc:
            raise ConfigError(f"training.engine=trl needs the 'trl' extra (pip install 'elm-memory[trl]'): {exc}") from None
        cfg = self.cfg
        if (objective or cfg.objective) != "grpo":
            raise ConfigError("training.objective=sft is only available with training.engine=native")
        if at != 0:
            raise ConfigError("training.engine=trl (PEFT prompt tuning) needs prompt.soft_prompt_position=prefix")
        if cfg.steps == 0:
            return TrainResult(init.detach().float().clone(), TrainingStats(engine=self.engine))

        model, tokenizer, info = self.loaded.model, self.loaded.tokenizer, self.loaded.info
        t_start = time.perf_counter()
        stats = TrainingStats(engine=self.engine, objective="grpo")
        prompt_text = tokenizer.decode(list(prompt_ids))
        if tokenizer(prompt_text)["input_ids"] != list(prompt_ids):
            raise TrainingError("TRL would tokenise the prompt differently from the native engine; refusing")

        def majority_reward(completions: list[str], **_: object) -> list[float]:
            rewards: list[float] = []
            G = cfg.num_generations
            for start in range(0, len(completions), G):  # TRL passes whole groups, G at a time
                group = majority_vote_rewards(completions[start : start + G])
                stats.answers.append(group.answers)
                stats.mean_reward.append(sum(group.rewards) / len(group.rewards))
                stats.skipped_backward.append(group.uniform)
                stats.majority_answer, stats.majority_share = group.vote.answer, group.vote.share
                rewards.extend(group.rewards)
            return rewards

        peft_cfg = PromptTuningConfig(
            task_type=TaskType.CAUSAL_LM,
            num_virtual_tokens=init.shape[0],
            prompt_tuning_init=PromptTuningInit.RANDOM,  # overwritten with our init below: same start as native
        )
        peft_model = get_peft_model(model, peft_cfg)
        with torch.no_grad():
            emb = peft_model.prompt_encoder["default"].embedding.weight
            emb.copy_(init.to(emb.dtype))
        on_cpu = info.device == "cpu"
        try:
            with tempfile.TemporaryDirectory(prefix="elm-trl-") as out_dir:
                args = GRPOConfig(
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
                dataset = Dataset.from_list([{"prompt": prompt_text}] * cfg.steps)
                trainer = GRPOTrainer(
                    model=peft_model,
                    reward_funcs=[majority_reward],
                    args=args,
                    train_dataset=dataset,
                    processing_class=tokenizer,
                )
                from transformers.trainer_callback import PrinterCallback, ProgressCallback

                trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
                if not progress:
                    trainer.remove_callback(ProgressCallback)
                trainer.train()
                for entry in trainer.state.log_history:
                    if "loss" in entry:
                        stats.loss.append(float(entry["loss"]))
                        stats.kl.append(float(entry.get("kl", 0.0)))
                        stats.completion_tokens += int(
                            entry.get("completions/mean_length", 0) * cfg.num_generations
                        )
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
