"""GPU check: what learning a memory and answering cost at the paper's settings on a CUDA device.

The GPU machines lent to this project cannot hold the packaged weights (they travel as files of at
most 64 MiB), so this runs the default model's *architecture* (its ``config.json`` and tokenizer)
with **random weights**, through the library's own loader, backend and trainer:

- ``learn``: :func:`learn_memory` with the paper's recipe (k=20, G=8, Dr.GRPO, lr 1e-4, beta 0.01,
  temperature 0.8) at a given S and completion cap, faithful (every group back-propagated, no early
  stop). Random weights never write ``\\boxed{}`` or stop, so every rollout runs to the cap: the
  times are the worst case for that cap, and the rewards (all 0) mean nothing.
- ``learn_together`` (``--memories M``): M memories at the same settings trained together, their
  rollouts decoded as one batch (:func:`learn_memories`); memories per hour beside ``learn``'s one.
- ``answer``: ELM's dual generation, the zero-shot and the memory-conditioned prompt decoded
  greedily in one batch, to the same cap.

    python -m benchmarks.gpu_check --config-dir DIR --runs 10x256,1x2048 --out results.json
    python -m benchmarks.gpu_check --config-dir DIR --device cpu --runs 1x8   # plumbing, any machine

``DIR`` holds the default model's ``config.json`` and tokenizer files (no weights). The CUDA tests
(``tests/test_cuda.py``) check that these paths compute what the CPU computes; this script only times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"  # noqa: E501
MODEL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _random_model_folder(config_dir: Path, dtype: str) -> Path:
    """The architecture in ``config_dir`` with random weights, saved as a model folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(config_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    folder = Path(tempfile.mkdtemp(prefix="elm-gpu-check-"))
    model.save_pretrained(folder)
    for name in MODEL_FILES:  # config.json comes with the weights
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, folder / name)
    return folder


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _timed_learning(call: Any) -> tuple[Any, float]:
    """``call()``'s result and its seconds, the GPU's peak memory counted from its start."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    out = call()
    _sync()
    return out, time.perf_counter() - t0


def _learn(cfg: Any, loaded: Any, backend: Any, prompts: Any) -> dict[str, Any]:
    import torch

    from elm_memory.training.learn import learn_memory

    memory, seconds = _timed_learning(
        lambda: learn_memory(QUESTION, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
    )
    s = memory.meta.stats
    tokens = s.completion_tokens
    return {
        "steps": cfg.training.steps,
        "num_generations": cfg.training.num_generations,
        "max_completion_length": cfg.training.max_completion_length,
        "seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / max(1, cfg.training.steps), 2),
        "generation_seconds": round(s.generation_seconds, 2),
        "backward_seconds": round(s.backward_seconds, 2),
        "completion_tokens": tokens,
        "rollout_tokens_per_second": round(tokens / s.generation_seconds, 1) if s.generation_seconds else None,
        "skipped_backward": s.skipped_backward,
        "finite": bool(torch.isfinite(memory.soft_prompt).all()),
        "peak_gpu_gib": _peak_gib(),
    }


def _learn_together(cfg: Any, loaded: Any, backend: Any, prompts: Any, memories: int) -> dict[str, Any]:
    """``memories`` memories trained together (:func:`learn_memories`: their rollouts decode as one batch)."""
    import torch

    from elm_memory.training.learn import learn_memories

    questions = [QUESTION.replace("48", str(48 + i)) for i in range(memories)]
    learned, seconds = _timed_learning(
        lambda: learn_memories(questions, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
    )
    stats = [m.meta.stats for m in learned]
    return {
        "memories": memories,
        "steps": cfg.training.steps,
        "num_generations": cfg.training.num_generations,
        "max_completion_length": cfg.training.max_completion_length,
        "seconds": round(seconds, 2),
        "seconds_per_memory": round(seconds / memories, 2),
        "memories_per_hour": round(3600 * memories / seconds, 1),
        "completion_tokens": sum(st.completion_tokens for st in stats),
        "finite": all(bool(torch.isfinite(m.soft_prompt).all()) for m in learned),
        "peak_gpu_gib": _peak_gib(),
    }


def answer_pair(cfg: Any, loaded: Any, prompts: Any) -> list[Any]:
    """ELM's two answer prompts: zero-shot, and with a question-initialised memory (on the CPU, as a
    stored memory is)."""
    from elm_memory.backends.base import PromptInput
    from elm_memory.training.initialization import question_init

    k = cfg.memory.num_tokens
    plain = prompts.answer_prompt(QUESTION, memory_tokens=0)
    with_memory = prompts.answer_prompt(QUESTION, memory_tokens=k)
    soft = question_init(loaded, QUESTION, k, cfg.memory.init, 0).cpu()
    return [
        PromptInput(tuple(plain.token_ids)),
        PromptInput(tuple(with_memory.token_ids), soft_prompt=soft, soft_prompt_at=with_memory.memory_at),
    ]


def _answer(cfg: Any, loaded: Any, backend: Any, prompts: Any, max_new_tokens: int) -> dict[str, Any]:
    """ELM's two candidates in one greedy batch: zero-shot, and with a question-initialised memory."""
    from elm_memory.backends.base import SamplingParams

    batch = answer_pair(cfg, loaded, prompts)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    _sync()
    t0 = time.perf_counter()
    out = backend.generate(batch, params)
    _sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for gens in out for g in gens)
    return {
        "max_new_tokens": max_new_tokens,
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1),
    }


def _runs(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(s), int(n)) for s, n in (part.split("x") for part in text.split(","))]
    except ValueError:
        raise SystemExit(f"--runs takes STEPSxLENGTH pairs, comma-separated (10x256,1x2048), not {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, required=True, help="the model's config.json and tokenizer files")
    ap.add_argument("--runs", type=_runs, default=_runs("10x256,1x2048"), help="STEPSxLENGTH,... (S steps, cap)")
    ap.add_argument("--device", default="auto", help="auto (the GPU when there is one) or cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--decode-graphs", default="auto", help="backend.decode_graphs: auto, on, off or static")
    ap.add_argument(
        "--memories", type=int, default=1, help="also train this many memories together at each run's settings"
    )
    args = ap.parse_args()
    if not (args.config_dir / "config.json").is_file():
        raise SystemExit(f"{args.config_dir} has no config.json")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it at import
    import torch
    import transformers

    from elm_memory.backends.hf import HFBackend
    from elm_memory.backends.prompting import PromptBuilder
    from elm_memory.config import ELMConfig
    from elm_memory.hardware import resolve_placement
    from elm_memory.models.loading import load_model

    model_cfg = {"device": args.device, "dtype": args.dtype}
    placement = resolve_placement(ELMConfig.load(overrides={"model": model_cfg}).model)
    t0 = time.perf_counter()
    folder = _random_model_folder(args.config_dir, placement.dtype)
    loaded = load_model(ELMConfig.load(overrides={"model": {**model_cfg, "name_or_path": str(folder)}}).model)
    setup_s = time.perf_counter() - t0
    backend = HFBackend(loaded, decode_graphs=args.decode_graphs)
    gpu = torch.cuda.get_device_name(0) if loaded.info.device.startswith("cuda") else None
    result: dict[str, Any] = {
        "what": "the default model's architecture with random weights; rollouts and answers run to the cap",
        "device": gpu or "cpu",
        "placement": placement.to_dict(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "architecture": {k: getattr(loaded.info, k) for k in ("model_type", "hidden_size", "num_layers", "vocab_size")},
        "setup_seconds": round(setup_s, 1),
        "decode_graphs": args.decode_graphs,
        "learn": [],
        "answer": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("learn", "answer")}), flush=True)

    for steps, length in args.runs:
        cfg = ELMConfig.load(
            overrides={
                "model": model_cfg,
                "training": {"steps": steps, "max_completion_length": length, "skip_uniform_rewards": False},
            }
        )
        prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
        # warm-up, not timed: kernels, the allocator and (captured steps) each shape bucket this run meets
        short = cfg.training.model_copy(update={"steps": 1})
        warm_s = time.perf_counter()
        _learn(cfg.model_copy(update={"training": short}), loaded, backend, prompts)
        _answer(cfg, loaded, backend, prompts, length)
        result.setdefault("warm_up_seconds", []).append(round(time.perf_counter() - warm_s, 1))
        learned = _learn(cfg, loaded, backend, prompts)
        result["learn"].append(learned)
        print(json.dumps({"learn": learned}), flush=True)
        answered = _answer(cfg, loaded, backend, prompts, length)
        result["answer"].append(answered)
        print(json.dumps({"answer": answered}), flush=True)
        if args.memories > 1:
            _learn_together(cfg.model_copy(update={"training": short}), loaded, backend, prompts, args.memories)
            together = _learn_together(cfg, loaded, backend, prompts, args.memories)
            result.setdefault("learn_together", []).append(together)
            print(json.dumps({"learn_together": together}), flush=True)
        if args.out:  # after every run: a run cut off by a time limit keeps what finished
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
