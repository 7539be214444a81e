"""Full-model GRPO on a whole question set: the paper's offline baselines (Table 1, green rows).

``TTRL`` trains the whole model with the majority-vote reward (no ground truth: 1 if a
rollout's ``\\boxed{}`` answer equals its group's majority answer, :mod:`elm_memory.training.rewards`);
``GRPO`` with the gold reward (1 if the answer is equivalent to the dataset's answer). Both run
through TRL's ``GRPOTrainer`` for a number of epochs over the questions.

The method's :class:`~elm_memory.config.TrainingConfig` maps onto TRL's ``GRPOConfig``
(:func:`grpo_config`): G -> ``num_generations``, beta -> ``beta``, the rollout temperature and
``top_p``, ``max_completion_length``, ``loss_type`` (``dr_grpo``), ``scale_rewards``,
``weight_decay``, ``max_grad_norm`` and ``seed``. Two settings are the full model's own
(:class:`FullModelSettings`): the learning rate, since the paper trains the full model at 1e-6,
not the soft prompt's 1e-4, and the questions per optimisation step, since the paper's global
batch is 64 completions (8 questions x G=8, no gradient accumulation).

The model trained is a float32 *copy* (:func:`trainable_copy`): the shared frozen model is never
touched, and float32 because an update of 1e-6 on a bfloat16 weight rounds away (bf16 keeps 8
bits of mantissa). On a GPU with bf16, TRL runs the forward in bf16 autocast over those float32
weights (``bf16=True``), as the paper's mixed-precision training does.
"""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from elm_memory.answers import equivalent, extract_answer
from elm_memory.config import TrainingConfig
from elm_memory.errors import ConfigError, NonFiniteError, TrainingError
from elm_memory.models.loading import LoadedModel
from elm_memory.training.rewards import majority_vote_rewards

Reward = Literal["majority", "gold"]
REWARDS: tuple[str, ...] = ("majority", "gold")

#: The largest model trained on a CPU without ``--force``, in parameters. SmolLM2-135M fits; the default
#: Qwen2.5-0.5B (494M) does not: its float32 copy, gradients and AdamW state take ~8 GB, and one step of
#: 64 rollouts of up to 2048 tokens is hours on a few cores.
CPU_MAX_PARAMETERS = 300_000_000

#: What a TRL reward function is: completions (and TRL's keyword arguments) in, one reward each out
#: (TRL's type: None would mean "no reward for this one"; these functions always give a number).
RewardFunction = Callable[..., list[float | None]]


@dataclass(frozen=True)
class FullModelSettings:
    """What full-model training adds to the method's training config."""

    epochs: int = 1
    reward: Reward = "majority"
    learning_rate: float = 1e-6  # paper (appendix): 1e-6 for full-model training
    questions_per_step: int = 8  # paper: global batch 64 = 8 questions x G=8

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"epochs must be at least 1, got {self.epochs}")
        if self.reward not in REWARDS:
            raise ConfigError(f"unknown reward {self.reward!r}; use majority (TTRL) or gold (GRPO)")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {self.learning_rate}")
        if self.questions_per_step < 1:
            raise ConfigError(f"questions per step must be at least 1, got {self.questions_per_step}")

    @property
    def method(self) -> str:
        """The paper's name for the row: TTRL (majority reward) or GRPO (gold reward)."""
        return "TTRL" if self.reward == "majority" else "GRPO"

    def to_json(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs,
            "reward": self.reward,
            "learning_rate": self.learning_rate,
            "questions_per_step": self.questions_per_step,
        }


@dataclass
class FullModelTraining:
    """What a training run did: per-step logs from TRL, the step layout and its time."""

    steps: list[dict[str, float]] = field(default_factory=list)
    questions: int = 0
    questions_per_step: int = 0
    epochs: int = 0
    seconds: float = 0.0
    grpo_config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "questions": self.questions,
            "questions_per_step": self.questions_per_step,
            "epochs": self.epochs,
            "optimizer_steps": len(self.steps),
            "seconds": round(self.seconds, 2),
            "steps": self.steps,
            "grpo_config": self.grpo_config,
        }


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def check_feasible(loaded: LoadedModel, *, force: bool = False) -> None:
    """Refuse full-model training of a model above :data:`CPU_MAX_PARAMETERS` on a CPU unless forced."""
    if loaded.info.device != "cpu" or force:
        return
    n = parameter_count(loaded.model)
    if n > CPU_MAX_PARAMETERS:
        raise ConfigError(
            f"full-model training of {loaded.info.name} ({n / 1e6:.0f}M parameters) on a CPU: above the "
            f"{CPU_MAX_PARAMETERS / 1e6:.0f}M-parameter limit for CPUs (float32 weights, gradients and AdamW state, "
            "and hours per step); use a GPU, a small model (preset cpu-tiny), or --force"
        )


def trainable_copy(loaded: LoadedModel) -> Any:
    """A float32 copy of the shared model to train; the shared model stays frozen and unchanged."""
    model = copy.deepcopy(loaded.model).to(torch.float32)
    model.requires_grad_(True)
    model.train()
    return model


def questions_per_step(n_questions: int, wanted: int) -> int:
    """The largest count <= ``wanted`` that divides ``n_questions``: TRL's sampler drops an epoch's last
    incomplete batch, so any other count would leave questions untrained in every epoch."""
    q = max(1, min(wanted, n_questions))
    while n_questions % q:
        q -= 1
    return q


def majority_reward(group_size: int) -> RewardFunction:
    """TTRL: each group of G rollouts of one prompt votes; a rollout whose answer is the majority's gets 1.
    Takes no answer column: the training set of this reward has none (see :func:`training_rows`)."""

    def reward(completions: list[str], prompts: list[str], **_: object) -> list[float | None]:
        rewards: list[float | None] = []
        for start in range(0, len(completions), group_size):  # TRL passes a prompt's G rollouts together
            if len(set(prompts[start : start + group_size])) != 1:
                raise TrainingError("TRL passed a group of rollouts from different prompts; majority vote refused")
            rewards.extend(majority_vote_rewards(completions[start : start + group_size]).rewards)
        return rewards

    return reward


def gold_reward() -> RewardFunction:
    """GRPO with ground truth: 1 when a rollout's final answer is equivalent to the question's gold answer."""

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
        return [float(equivalent(extract_answer(c), gold)) for c, gold in zip(completions, answer, strict=True)]

    return reward


def training_rows(prompts: Sequence[str], golds: Sequence[str] | None) -> list[dict[str, str]]:
    """TRL's training set: the prompts, and the gold answers only when given (gold reward). TRL hands
    every column to every reward function, so a TTRL set must not hold the answers at all."""
    if golds is None:
        return [{"prompt": p} for p in prompts]
    if len(golds) != len(prompts):
        raise ConfigError(f"{len(golds)} gold answers for {len(prompts)} prompts")
    return [{"prompt": p, "answer": g} for p, g in zip(prompts, golds, strict=True)]


def grpo_config(
    cfg: TrainingConfig,
    settings: FullModelSettings,
    loaded: LoadedModel,
    *,
    per_step: int,
    output_dir: str,
    progress: bool | None,
) -> Any:
    """TRL's ``GRPOConfig`` for the method's training knobs and the full model's settings."""
    from trl import GRPOConfig

    on_cpu = loaded.info.device == "cpu"
    g = cfg.num_generations
    return GRPOConfig(
        output_dir=output_dir,
        num_train_epochs=settings.epochs,
        per_device_train_batch_size=per_step * g,  # `per_step` questions x G rollouts
        gradient_accumulation_steps=1,  # paper: no gradient accumulation
        num_generations=g,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.effective_temperature(loaded.info.model_type),
        top_p=cfg.top_p,
        top_k=0,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",  # paper: constant learning rate
        warmup_steps=0,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
        optim="adamw_torch" if on_cpu else "adamw_torch_fused",  # paper: fused AdamW (a GPU kernel)
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        scale_rewards="group" if cfg.scale_rewards else "none",
        num_iterations=1,
        activation_checkpointing=False,  # TRL turns it on; ~4x slower measured on CPU (the TRL soft-prompt engine)
        bf16=not on_cpu and loaded.info.dtype == "bfloat16",
        use_cpu=on_cpu,
        seed=cfg.seed if cfg.seed is not None else 0,
        shuffle_dataset=True,  # a new question order every epoch (seeded)
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )


def train_full_model(
    model: Any,
    loaded: LoadedModel,
    prompts: Sequence[str],
    cfg: TrainingConfig,
    settings: FullModelSettings,
    *,
    golds: Sequence[str] | None = None,
    reward_function: RewardFunction | None = None,
    progress: bool | None = None,
) -> FullModelTraining:
    """Train ``model`` (a :func:`trainable_copy`) in place on ``prompts`` (TRL's text prompts) with the
    reward of ``settings``. ``golds`` must be given for the gold reward and must not be for the majority
    reward. ``reward_function`` replaces the reward (tests). After training the model is in eval mode,
    gradients off."""
    _require_trl()
    if (settings.reward == "gold") != (golds is not None):
        raise ConfigError("gold answers are needed by the gold reward and must not reach the majority reward")
    if not prompts:
        raise ConfigError("no questions to train on")
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    per_step = questions_per_step(len(prompts), settings.questions_per_step)
    rewards = reward_function or (gold_reward() if settings.reward == "gold" else majority_reward(cfg.num_generations))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="elm-full-model-") as out_dir:
        args = grpo_config(cfg, settings, loaded, per_step=per_step, output_dir=out_dir, progress=progress)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[rewards],
            args=args,
            train_dataset=Dataset.from_list(training_rows(prompts, golds)),
            processing_class=loaded.tokenizer,
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
        if not progress:
            trainer.remove_callback(ProgressCallback)
        with warnings.catch_warnings():
            # transformers warns about a deprecated name that TRL itself calls; nothing a user can change
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            trainer.train()
    model.eval()
    model.requires_grad_(False)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise NonFiniteError("the model's weights became non-finite during full-model training")
    return FullModelTraining(
        steps=[_step_log(entry) for entry in trainer.state.log_history if "loss" in entry],
        questions=len(prompts),
        questions_per_step=per_step,
        epochs=settings.epochs,
        seconds=time.perf_counter() - t0,
        grpo_config=_mapped_fields(args),
    )


def _step_log(entry: dict[str, Any]) -> dict[str, float]:
    keys = {"loss": "loss", "reward": "reward", "kl": "kl", "completion_length": "completions/mean_length"}
    return {name: float(entry[key]) for name, key in keys.items() if key in entry}


#: The GRPOConfig fields this module sets from the config (recorded in the run's training.json).
MAPPED_FIELDS = (
    "num_train_epochs",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "learning_rate",
    "lr_scheduler_type",
    "weight_decay",
    "max_grad_norm",
    "beta",
    "loss_type",
    "scale_rewards",
    "bf16",
    "seed",
)


def _mapped_fields(args: Any) -> dict[str, Any]:
    return {name: _plain(getattr(args, name)) for name in MAPPED_FIELDS}


def _plain(value: Any) -> Any:
    """A JSON value: TRL keeps some settings as enums."""
    return value if isinstance(value, bool | int | float | str) or value is None else str(value)


def _require_trl() -> None:
    """Fail early, with the extra to install, when TRL is missing."""
    try:
        from datasets import Dataset  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"full-model training needs the 'trl' extra (pip install 'elm-memory[trl]'): {exc}") from None
