"""The full-model offline baselines (paper Table 1, green rows; ``elm offline --full-model``).

The whole model is trained on the set's questions for a number of epochs with TTRL (majority-vote
reward, no ground truth; default) or GRPO (gold reward), through TRL's ``GRPOTrainer``
(:mod:`elm_memory.training.full_model`), then answers every question greedily, next to the
untrained model's zero-shot answers. Both are answered by the same float32 copy of the model (before
and after training), so the comparison never mixes dtypes; the shared model is not changed.

Output directory (the offline protocol's layout)::

    run.json          what was run (dataset, question ids, config, full-model settings)
    zero_shot.jsonl   one line per question: the untrained model's greedy answer
    training.json     TRL's per-step loss, reward and KL, the GRPOConfig fields set, seconds
    full_model.jsonl  one line per question: the trained model's greedy answer
    summary.json, results.md
    model/            the trained model (safetensors, ``save_pretrained``), only with ``save_model``

Re-running resumes: nothing is recomputed once every question has both answers. A run killed after
training but before the last answer trains again (its answers so far are dropped, as they came from
a model that is gone), unless the trained model was saved: then it is loaded instead.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import Problem
from elm_memory.environment import code_version
from elm_memory.errors import ConfigError
from elm_memory.eval.offline import OfflineResult, greedy_answers
from elm_memory.eval.progress import ProgressBar
from elm_memory.eval.records import (
    RecordLog,
    check_manifest,
    config_defaults,
    machine_facts,
    run_dir,
    write_json_atomic,
)
from elm_memory.training.full_model import FullModelSettings, RewardFunction

RESUME_FIELDS = ("dataset", "seed", "question_ids", "train_ids", "config", "full_model")
MODEL_DIR = "model"


def run_full_model(
    problems: Sequence[Problem],
    config: ELMConfig,
    out_dir: str | Path,
    *,
    settings: FullModelSettings | None = None,
    dataset: str = "custom",
    seed: int | None = None,
    train: int | None = None,
    save_model: bool = False,
    force: bool = False,
    batch_size: int = 8,
    loaded: Any = None,
    progress: bool | None = None,
    reward_function: RewardFunction | None = None,
) -> OfflineResult:
    """Train a copy of the model on the first ``train`` questions (all by default) and answer every
    question with it and, before training, zero-shot. ``loaded``: a model already in memory (it is
    copied, never changed). ``force``: train a model above the CPU size limit anyway.
    ``reward_function`` replaces the reward (tests)."""
    settings = settings or FullModelSettings()
    out = run_dir(out_dir)
    if not problems:
        raise ConfigError("no questions to run")
    if batch_size < 1:
        raise ConfigError("batch_size must be at least 1")
    train_set = list(problems[: train or len(problems)])
    check_manifest(
        out,
        {
            "dataset": dataset,
            "seed": seed,
            "question_ids": [p.id for p in problems],
            "train_ids": [p.id for p in train_set],
            "config": config.model_dump(mode="json"),
            "full_model": settings.to_json(),
            "methods": [f"full_model_{settings.reward}"],
            "machines": [machine_facts(config)],
            "code_versions": [code_version()],
        },
        RESUME_FIELDS,
        config_defaults(),
    )
    _FullModelRun(config, settings, out, loaded).run(
        problems, train_set, batch_size, save_model=save_model, force=force, progress=progress, reward=reward_function
    )
    return finish(out)


class _FullModelRun:
    """One run: its logs, the float32 copy it answers and trains with (made on first need), and its phases."""

    def __init__(self, config: ELMConfig, settings: FullModelSettings, out: Path, loaded: Any):
        self.config, self.settings, self.out, self._given = config, settings, out, loaded
        self.zs_log, self.fm_log = RecordLog(out / "zero_shot.jsonl"), RecordLog(out / "full_model.jsonl")
        self.loaded: Any = None  # the copy, wrapped as a LoadedModel

    def run(
        self,
        problems: Sequence[Problem],
        train_set: list[Problem],
        batch_size: int,
        *,
        save_model: bool,
        force: bool,
        progress: bool | None,
        reward: RewardFunction | None,
    ) -> None:
        zs_done = {r["question_id"] for r in self.zs_log.read()}
        fm_done = {r["question_id"] for r in self.fm_log.read()}
        todo_zs = [p for p in problems if p.id not in zs_done]
        if not todo_zs and all(p.id in fm_done for p in problems):
            return  # finished: loads nothing
        self._prepare(force)
        with ProgressBar(progress, total=len(problems), completed=len(problems) - len(todo_zs)) as bar:
            bar.describe("zero-shot")
            self._answer(todo_zs, self.zs_log, batch_size, bar)
        saved = self.out / MODEL_DIR
        if (self.out / "training.json").is_file() and (saved / "config.json").is_file():
            self._use_saved(saved)
        else:
            fm_done = set()
            self._forget_trained()
            self._train(train_set, save_model=save_model, progress=progress, reward=reward)
        todo = [p for p in problems if p.id not in fm_done]
        with ProgressBar(progress, total=len(problems), completed=len(problems) - len(todo)) as bar:
            bar.describe(f"{self.settings.method} model")
            self._answer(todo, self.fm_log, batch_size, bar)

    def _prepare(self, force: bool) -> None:
        """Load (or take) the model, refuse one too large to train here, and make the float32 copy."""
        from elm_memory.models.loading import load_model
        from elm_memory.training.full_model import check_feasible, trainable_copy

        base = self._given or load_model(self.config.model)
        check_feasible(base, force=force)
        model = trainable_copy(base)
        model.eval()
        model.requires_grad_(False)
        self.loaded = replace(base, model=model, info=replace(base.info, dtype="float32"), load_seconds=0.0)

    def _answer(self, todo: list[Problem], log: RecordLog, batch_size: int, bar: ProgressBar) -> None:
        """Greedy answers of the current copy (the hf backend: the weights are this process's own)."""
        if not todo:
            return
        from elm_memory.backends.hf import HFBackend
        from elm_memory.backends.prompting import PromptBuilder

        backend = HFBackend.from_config(self.config, loaded=self.loaded)
        prompts = PromptBuilder(self.loaded.tokenizer, self.config.prompt, max_context=self.loaded.info.max_context)
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            for p, (answer, text) in zip(chunk, greedy_answers(self.config, prompts, backend, chunk), strict=True):
                correct = bool(equivalent(answer, p.answer))
                log.append(
                    {"question_id": p.id, "answer": answer, "correct": correct, "gold": p.answer, "response": text}
                )
                bar.advance()

    def _train(
        self, train_set: list[Problem], *, save_model: bool, progress: bool | None, reward: RewardFunction | None
    ) -> None:
        from elm_memory.backends.prompting import PromptBuilder
        from elm_memory.training.full_model import train_full_model
        from elm_memory.training.trl_engine import trl_prompt_text

        cfg, tokenizer = self.config, self.loaded.tokenizer
        prompts = PromptBuilder(tokenizer, cfg.prompt, max_context=self.loaded.info.max_context)
        texts = [
            trl_prompt_text(tokenizer, prompts.answer_prompt(p.question, memory_tokens=0).token_ids) for p in train_set
        ]
        # The gold answers are read here and only for the gold reward: TTRL never holds them.
        golds = [p.answer for p in train_set] if self.settings.reward == "gold" else None
        model = self.loaded.model
        model.requires_grad_(True)
        model.train()
        training = train_full_model(
            model,
            self.loaded,
            texts,
            cfg.training,
            self.settings,
            golds=golds,
            reward_function=reward,
            progress=progress,
        )
        record = {"method": self.settings.method, "settings": self.settings.to_json(), **training.to_json()}
        if save_model:
            self._save(model)
            record["saved_model"] = MODEL_DIR
        write_json_atomic(self.out / "training.json", record)  # last: it marks a saved model as complete

    def _save(self, model: Any) -> None:
        """``save_pretrained`` (safetensors) with the tokenizer, into a temporary folder renamed into place."""
        tmp = self.out / f"{MODEL_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        self.loaded.tokenizer.save_pretrained(tmp)
        tmp.rename(self.out / MODEL_DIR)

    def _use_saved(self, saved: Path) -> None:
        """Answer with the model a previous run trained and saved, instead of training again."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).to(self.loaded.info.device)
        model.eval()
        model.requires_grad_(False)
        self.loaded = replace(self.loaded, model=model)

    def _forget_trained(self) -> None:
        """Before training again: the answers, log and saved weights of an earlier training are stale."""
        for name in ("full_model.jsonl", "training.json"):
            (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(self.out / MODEL_DIR, ignore_errors=True)


def finish(out: Path) -> OfflineResult:
    """The summary and table of a finished run, from its files (loads no model)."""
    import json

    from elm_memory.eval.metrics import negative_flip_rate, oracle_accuracy
    from elm_memory.eval.report import markdown_full_model

    manifest = json.loads((out / "run.json").read_text(encoding="utf-8"))
    training_path = out / "training.json"
    training = json.loads(training_path.read_text(encoding="utf-8")) if training_path.is_file() else {}
    zs = {r["question_id"]: bool(r["correct"]) for r in RecordLog(out / "zero_shot.jsonl").read()}
    fm = {r["question_id"]: bool(r["correct"]) for r in RecordLog(out / "full_model.jsonl").read()}
    settings = manifest["full_model"]
    rewards = [s["reward"] for s in training.get("steps", []) if "reward" in s]
    summary = {
        "protocol": "full_model",
        "method": "TTRL" if settings["reward"] == "majority" else "GRPO",
        "settings": settings,
        "n_questions": len(zs),
        "n_trained": len(manifest["train_ids"]),
        "zero_shot_accuracy": sum(zs.values()) / len(zs) if zs else None,
        "full_model_accuracy": sum(fm.values()) / len(fm) if fm else None,
        "oracle_accuracy": oracle_accuracy(zs, fm) if zs.keys() & fm.keys() else None,
        "negative_flip_rate": negative_flip_rate(zs, fm),
        "gains": sum(fm[q] and not zs[q] for q in fm.keys() & zs.keys()),
        "losses": sum(zs[q] and not fm[q] for q in fm.keys() & zs.keys()),
        "optimizer_steps": training.get("optimizer_steps"),
        "questions_per_step": training.get("questions_per_step"),
        "mean_reward_first_step": rewards[0] if rewards else None,
        "mean_reward_last_step": rewards[-1] if rewards else None,
        "training_seconds": training.get("seconds"),
        "saved_model": str(out / MODEL_DIR) if training.get("saved_model") else None,
    }
    table = markdown_full_model(summary)
    write_json_atomic(out / "summary.json", summary)
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    return OfflineResult(out_dir=out, summary=summary, table=table)
