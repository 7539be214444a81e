"""Decode steps of the HF backend: the plain loop against captured steps, in milliseconds per step.

The default model's architecture with random weights (as ``gpu_check``: the packaged weights cannot
travel to a lent GPU), so every row decodes to its cap. Cases, each through ``HFBackend.generate``
with what the answer and rollout paths use (a soft prompt, per-prompt seeds, stop-at-answer):

- ``rollouts x8``: one prompt with a 20-vector soft prompt, 8 seeded samples (a GRPO group);
- ``rollouts x64``: eight such prompts, 8 samples each;
- ``answer pair``: ELM's greedy zero-shot + memory prompts.

A step's cost is ``(t(steps + short) - t(short)) / steps`` (``--short-tokens``, 8 unless set): prefill and
per-call work cancel out. The first call per case and path is timed apart (``first_call_s``: it compiles
each bucket on the captured path).

``--paths`` may also name ``on-repeat``: the captured steps with transformers' attention, which copies
each key/value head per query head (:mod:`elm_memory.backends.packed_attention` is what ``on`` uses
instead); and ``bare``: the reference of what the step itself can cost, timed in the same
process: a bare loop over ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` on a
static cache with ``torch.multinomial`` sampling, as many rows as the case (the method of
``hf_decode_limits.py``'s ``compiled_forward_loop``, without the library: no soft prompt, seeds or stops).

    python -m benchmarks.decode_graphs --config-dir DIR --out decode_graphs.json
    python -m benchmarks.decode_graphs --config-dir DIR --paths off,static --device cpu --steps 16  # any machine

``DIR`` holds the model's ``config.json`` and tokenizer files. Run it on a GPU beside
``hf_decode_limits.py`` (the reference rows) in the same process run of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import _random_model_folder, _sync

PROMPT_TOKENS = 128
SOFT_TOKENS = 20


def _cases(loaded: Any, steps: int) -> dict[str, tuple[list[Any], Any]]:
    import torch

    from elm_memory.backends.base import PromptInput, SamplingParams

    g = torch.Generator().manual_seed(0)
    hidden = loaded.info.hidden_size
    embed = loaded.model.get_input_embeddings().weight

    def prompt(i: int) -> Any:
        ids = torch.randint(100, min(loaded.info.vocab_size, 30000), (PROMPT_TOKENS,), generator=g).tolist()
        soft = (torch.randn(SOFT_TOKENS, hidden, generator=g) * float(embed.float().std())).to(embed.dtype)
        return PromptInput(tuple(ids), soft_prompt=soft, soft_prompt_at=8, seed=100 + i)

    sampled = SamplingParams(max_new_tokens=steps, temperature=0.8, n=8, seed=1, stop_at_answer=True)
    greedy = SamplingParams(max_new_tokens=steps, stop_at_answer=True)
    plain = PromptInput(tuple(prompt(99).token_ids))
    return {
        "rollouts x8": ([prompt(0)], sampled),
        "rollouts x64": ([prompt(i) for i in range(8)], sampled),
        "answer pair": ([plain, prompt(1)], greedy),
    }


def _timed(backend: Any, prompts: list[Any], params: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    backend.generate(prompts, params)
    _sync()
    return time.perf_counter() - t0


def _measure(
    backend: Any, prompts: list[Any], params: Any, steps: int, repeats: int, short_tokens: int = 8
) -> dict[str, Any]:
    import dataclasses

    long = dataclasses.replace(params, max_new_tokens=steps + short_tokens)
    short = dataclasses.replace(params, max_new_tokens=short_tokens)
    first = _timed(backend, prompts, long)  # compiles the captured path's buckets for this case
    _timed(backend, prompts, short)
    per_step = []
    for _ in range(repeats):
        t_long, t_short = _timed(backend, prompts, long), _timed(backend, prompts, short)
        per_step.append(round(1000 * (t_long - t_short) / steps, 3))
    return {"ms_per_step": min(per_step), "all_ms_per_step": per_step, "first_call_s": round(first, 2)}


def _bare_loop(loaded: Any, rows: int, steps: int, repeats: int) -> dict[str, Any]:
    """ms per step of a bare compiled-forward loop with ``rows`` rows (see the module's docstring)."""
    import torch
    from transformers import StaticCache

    model = loaded.model
    device = next(model.parameters()).device
    prompt = PROMPT_TOKENS + SOFT_TOKENS
    cache = StaticCache(config=model.config, max_cache_len=prompt + 3 + repeats * steps + 8)
    ids = torch.randint(100, 30000, (rows, prompt), device=device)
    forward = torch.compile(model.forward, mode="reduce-overhead" if device.type == "cuda" else None, fullgraph=True)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, cache_position=torch.arange(prompt, device=device), use_cache=True)
        token = out.logits[:, -1:].argmax(-1).clone()
        position = torch.tensor([prompt], device=device)
        t0 = time.perf_counter()
        for _ in range(3):  # compiles, then records the graph
            forward(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True)
            position.add_(1)
        _sync()
        compile_s = time.perf_counter() - t0
        per_step = []
        for _ in range(repeats):
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = forward(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits
                token.copy_(torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1))
                position.add_(1)
            _sync()
            per_step.append(round(1000 * (time.perf_counter() - t0) / steps, 3))
    return {"ms_per_step": min(per_step), "all_ms_per_step": per_step, "first_call_s": round(compile_s, 2)}


def _profile(backend: Any, prompts: list[Any], params: Any, out: Path, tokens: int = 40) -> None:
    """Top operators by self CPU and by device time over one ``tokens``-token call, as a text table."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    import torch

    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    call = dataclasses.replace(params, max_new_tokens=tokens)
    _timed(backend, prompts, call)
    with profile(activities=activities) as prof:
        _timed(backend, prompts, call)
    table = prof.key_averages()
    text = table.table(sort_by="self_cpu_time_total", row_limit=25)
    if torch.cuda.is_available():
        text += "\n" + table.table(sort_by="self_device_time_total", row_limit=15)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, required=True, help="the model's config.json and tokenizer files")
    ap.add_argument(
        "--paths", default="off,on", help="backend.decode_graphs values to compare (off,on,static), on-repeat, bare"
    )
    ap.add_argument("--cases", default="rollouts x8,rollouts x64,answer pair")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per call")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--short-tokens",
        type=int,
        default=8,
        help="tokens of the short call subtracted from the long one (120: both calls in one cache bucket, "
        "so the captured path compiles one shape per case instead of two)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None, help="after the timings, profile one call per path here")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if bad := [p for p in paths if p not in ("off", "on", "on-repeat", "static", "auto", "bare")]:
        raise SystemExit(f"--paths: unknown {bad}; choose from off, on, on-repeat, static, auto, bare")
    if not (args.config_dir / "config.json").is_file():
        raise SystemExit(f"{args.config_dir} has no config.json")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from elm_memory.backends.hf import HFBackend
    from elm_memory.config import ELMConfig
    from elm_memory.hardware import resolve_placement
    from elm_memory.models.loading import load_model

    model_cfg = {"device": args.device, "dtype": args.dtype}
    placement = resolve_placement(ELMConfig.load(overrides={"model": model_cfg}).model)
    folder = _random_model_folder(args.config_dir, placement.dtype)
    loaded = load_model(ELMConfig.load(overrides={"model": {**model_cfg, "name_or_path": str(folder)}}).model)
    cases = _cases(loaded, args.steps)
    wanted = args.cases.split(",")
    if bad := [c for c in wanted if c not in cases]:
        raise SystemExit(f"--cases: unknown {bad}; choose from {', '.join(cases)}")
    result: dict[str, Any] = {
        "what": "ms per decode step through HFBackend.generate; random weights, every row runs to the cap",
        "device": torch.cuda.get_device_name(0) if loaded.info.device.startswith("cuda") else platform.processor(),
        "placement": placement.to_dict(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "steps": args.steps,
        "short_tokens": args.short_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "soft_prompt_tokens": SOFT_TOKENS,
        "cases": {},
    }
    for path in paths:
        if path == "bare":  # the reference, outside the library
            for name in wanted:
                prompts, params = cases[name]
                row = _bare_loop(loaded, len(prompts) * params.n, args.steps, args.repeats)
                result["cases"].setdefault(name, {})[path] = row
                print(json.dumps({"case": name, "path": path, **row}), flush=True)
            continue
        backend = HFBackend(loaded, decode_graphs="on" if path == "on-repeat" else path)
        if path == "on-repeat":  # captured steps whose attention copies the key/value heads (before packing)
            steps = backend._captured_steps()
            assert steps is not None
            steps.pack_query_heads = False
        for name in wanted:
            prompts, params = cases[name]
            row = _measure(backend, prompts, params, args.steps, args.repeats, args.short_tokens)
            if backend._captured is not None:
                row["buckets_so_far"] = list(backend._captured.buckets_seen)  # this backend's, all cases so far
            result["cases"].setdefault(name, {})[path] = row
            print(json.dumps({"case": name, "path": path, **row}), flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=2) + "\n")
        if args.profile:  # where a step's time goes: the first case, short, after its buckets are compiled
            prompts, params = cases[wanted[0]]
            tokens = max(40, args.short_tokens)  # a bucket the timings compiled already
            _profile(backend, prompts, params, args.profile / f"profile_{path}.txt", tokens)
    for by_path in result["cases"].values():
        if "off" in by_path and "on" in by_path:
            by_path["speedup_on_vs_off"] = round(by_path["off"]["ms_per_step"] / by_path["on"]["ms_per_step"], 2)
        if "on-repeat" in by_path and "on" in by_path:
            by_path["speedup_packed_vs_repeat"] = round(
                by_path["on-repeat"]["ms_per_step"] / by_path["on"]["ms_per_step"], 2
            )
        if "bare" in by_path and "on" in by_path:
            by_path["on_over_bare"] = round(by_path["on"]["ms_per_step"] / by_path["bare"]["ms_per_step"], 2)
    print(json.dumps(result["cases"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
