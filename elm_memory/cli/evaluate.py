"""``elm demo``, ``stream``, ``compare``, ``report`` and ``offline``: the evaluation protocols."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from elm_memory.cli.application import app
from elm_memory.cli.errors import handle_errors
from elm_memory.cli.options import (
    BackendOpt,
    ConfigOpt,
    JsonOpt,
    PresetOpt,
    ServerUrlOpt,
    SetOpt,
    load_config,
)


@app.command()
@handle_errors
def demo(
    dataset: Annotated[
        str,
        typer.Option(
            help="Vendored dataset: synth-arith (toy stream, default), synth-multistep (harder toy stream), "
            "gsm8k, math500, math500-easy (levels 1-3), amc23, aime24."
        ),
    ] = "synth-arith",
    limit: Annotated[int, typer.Option(min=1, help="Number of questions in the stream.")] = 8,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory (default elm-runs/demo-DATASET-LIMIT, with --amortized "
            "elm-runs/demo-amortized-DATASET-LIMIT); re-running resumes it."
        ),
    ] = None,
    amortized: Annotated[
        bool,
        typer.Option(
            "--amortized",
            help="Run the amortized stream memory (elm_amortized, preset cpu-amortized unless --preset) instead: "
            "per question every row's answer and tokens, ELM's mode and the gate's state. The gate opens only after "
            "stream.tuning.gate_min_questions (16) probed questions and enough evidence for stream.tuning.gate_test, "
            "so on a "
            "short stream it stays in warm-up and ELM spends more tokens than self-consistency; they fall only on "
            "longer streams "
            "(docs/stream-memory.md).",
        ),
    ] = False,
    config: ConfigOpt = None,
    preset: Annotated[
        str | None,
        typer.Option("--preset", "-p", help="Named preset (default cpu-demo; with --amortized cpu-amortized)."),
    ] = None,
    json_out: JsonOpt = False,
    set_: SetOpt = None,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
) -> None:
    """The main job on the embedded defaults: ELM next to zero-shot and self-consistency on a short online stream.

    Same as ``elm stream --dataset synth-arith --limit 8 -m zero_shot,elm_input --preset cpu-demo
    --out elm-runs/demo-synth-arith-8``: each question is answered (retrieve, dual-generate, route),
    then a memory is learned from it before the next one (the paper's protocol). Zero-shot is
    ELM's own zero-shot candidate (one shared cached generation), so it costs nothing extra.
    Self-consistency (the greedy answer and ELM's k seeded verifier samples, majority vote: ELM's compute
    without the memory) and the retrieved memory untrained are read from ELM's own generations
    (docs/evaluation-baselines.md). Per question it prints the route, the memory used and where it came
    from, both candidates and which was right; then one summary table and the plots (``elm report RUN``
    prints the full tables). ``--amortized``: the amortized stream memory instead (``-m elm_amortized``).
    """
    from elm_memory.data.datasets import load_problems
    from elm_memory.eval.paired import replay_settings
    from elm_memory.eval.walkthrough import AmortizedWalkthrough, Walkthrough, amortized_summary, summary_table

    cfg = load_config(config, preset or ("cpu-amortized" if amortized else "cpu-demo"), None, set_, backend, server_url)
    problems = load_problems(dataset, limit=limit, seed=17)
    name = "demo-amortized" if amortized else "demo"
    out = out or Path("elm-runs") / f"{name}-{Path(dataset).stem}-{limit}"
    echo = lambda line: typer.echo(line, err=True)  # noqa: E731
    walkthrough: Any = None
    if amortized:
        methods = ["elm_amortized"]
        walkthrough = None if json_out else AmortizedWalkthrough(len(problems), echo)
        result = _run_stream(problems, methods, cfg, out, dataset, 17, json_out, True, on_record=walkthrough)
        table = amortized_summary(result.records, min_questions=cfg.stream.tuning.gate_min_questions)
        full = "every row per part, the planned sign tests, the labels' quality, the gate's decisions"
    else:
        methods = ["zero_shot", "elm_input"]
        paired = replay_settings(cfg.model_dump(mode="json"))
        walkthrough = None if json_out else Walkthrough(len(problems), echo, paired=paired)
        result = _run_stream(problems, methods, cfg, out, dataset, 17, json_out, True, on_record=walkthrough)
        table = summary_table(result.summary, result.records, cfg.model_dump(mode="json"))
        full = "routes, timings, head to head, the self-consistency counterfactual, the paired rows, any stream memory"
    if json_out:
        _print_run(result, json_out)
        return
    typer.echo(table)
    typer.echo(f"records.jsonl, summary.json, results.md in {result.out_dir}")
    for p in result.plots:
        typer.echo(f"plot: {p}")
    typer.echo(f"The full tables ({full}): elm report {result.out_dir}")


MethodOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--method",
        "-m",
        help="Method(s), repeatable or comma-separated: zero_shot, self_consistency, maj_at_k, verifier_at_2, "
        "icl, reasoning_bank, lag, lag_tts, elm_input, elm_untrained, elm_kv, elm_kv_centered, elm_stream, "
        "elm_stream_objectives, elm_stream_sources, elm_stream_gold (an upper bound: learns from the gold "
        "answer), zero_shot_format (or a plugin).",
    ),
]


DatasetOpt = Annotated[
    str,
    typer.Option(
        help="gsm8k, math500, math500-easy (MATH500 levels 1-3), amc23, aime24, synth-arith (toy), "
        "synth-multistep (harder toy), or a JSONL file with question/answer."
    ),
]
NoPlotsOpt = Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")]


def _methods(values: list[str] | None, default: list[str]) -> list[str]:
    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    return names or default


@app.command()
@handle_errors
def stream(
    dataset: DatasetOpt,
    out: Annotated[Path, typer.Option(help="Run directory (records, summary, plots, memory pools). Re-run to resume.")],
    method: MethodOpt = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Questions to run (after shuffling).")] = None,
    seed: Annotated[int | None, typer.Option(help="Stream order seed (paper: 17, 42, 78). Default 17.")] = 17,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    no_plots: NoPlotsOpt = False,
    batch_size: Annotated[int, typer.Option(min=1, help="Questions per call for memoryless methods.")] = 8,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
    paired: Annotated[
        bool,
        typer.Option(
            "--paired/--no-paired",
            help="ELM methods also record their untrained twin's answer and the samples self-consistency "
            "votes on, so the table shows those baselines on ELM's own generations (docs/evaluation-baselines.md).",
        ),
    ] = True,
) -> None:
    """The paper's online protocol: questions one at a time; each method answers, then learns (sync)."""
    from elm_memory.data.datasets import load_problems

    cfg = load_config(config, preset, None, set_, backend, server_url)
    problems = load_problems(dataset, limit=limit, seed=seed)
    methods = _methods(method, ["zero_shot", "elm_input"])
    result = _run_stream(problems, methods, cfg, out, dataset, seed, json_out, not no_plots, batch_size, paired=paired)
    _print_run(result, json_out)


def _run_stream(problems, methods, cfg, out, dataset, seed, quiet, plots, batch_size=8, on_record=None, paired=True):
    from elm_memory.eval.online import run_stream

    def show(r: dict[str, Any]) -> None:
        if quiet:
            return
        if on_record is not None:
            on_record(r)
            return
        mem = _memory_used(r)
        mark = "✓" if r["correct"] else "✗"
        typer.echo(
            f"[{r['index'] + 1}/{len(problems)}] {r['method']:<14} {r['question_id']:<12} {r['answer']!s:>10} "
            f"(gold {r['gold']}) {mark}  {r['route']:<9} {mem}  answer {r['timings']['answer']:.0f}s "
            f"learn {r['timings']['learn']:.0f}s",
            err=True,
        )

    return run_stream(
        problems,
        methods,
        cfg,
        out,
        dataset=dataset,
        seed=seed,
        on_record=show,
        plots=plots,
        progress=None if not quiet else False,
        batch_size=batch_size,
        paired=paired,
    )


def _memory_used(record: dict[str, Any]) -> str:
    """What a record's answer had of a memory, for its progress line: a retrieved one, the stream memory's version
    and gate (amortized serving), or none."""
    if record.get("memory_id"):
        return f"memory {str(record['memory_id'])[:8]} sim {record['similarity']:.2f}"
    extra = record.get("extra") or {}
    turn = (extra.get("amortized") or {}).get("turn")
    if turn:
        version = turn.get("version")
        held = "untrained" if version is None else f"v{version}"
        return f"stream memory {held}, gate {turn.get('gate')}, {turn.get('tokens')} tokens"
    return "stream memory" if "stream" in extra else "no memory"


def _print_run(result, json_out: bool, files: str = "records.jsonl, summary.json, results.md") -> None:
    """An evaluation run's result: the table and where its files are, or one JSON object."""
    if json_out:
        typer.echo(
            json.dumps(
                {"out_dir": str(result.out_dir), "summary": result.summary, "plots": [str(p) for p in result.plots]}
            )
        )
        return
    typer.echo(result.table)
    typer.echo(f"\n{files} in {result.out_dir}")
    for p in result.plots:
        typer.echo(f"plot: {p}")


@app.command()
@handle_errors
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Online run directories (`elm stream --out`), one per seed.")],
    out: Annotated[Path | None, typer.Option(help="Also write the comparison here (.json or .md).")] = None,
    partial: Annotated[
        bool, typer.Option("--partial", help="Accept runs that have not answered every question yet.")
    ] = False,
    first: Annotated[
        int | None, typer.Option(min=1, help="Compare the first N questions of each run (an online run is causal).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Mean and spread over online runs that differ only in their seed (reads files, loads no model)."""
    from elm_memory.eval.records import write_json_atomic
    from elm_memory.eval.seeds import compare_seeds, markdown_seeds

    comparison = compare_seeds(runs, partial=partial, first=first)
    table = markdown_seeds(comparison)
    if out is not None:
        if out.suffix == ".json":
            write_json_atomic(out, comparison.to_json())
        else:
            out.write_text(table, encoding="utf-8")
    if json_out:
        typer.echo(json.dumps(comparison.to_json()))
        return
    typer.echo(table)
    if comparison.unrecorded:
        typer.echo(f"settings not recorded by every run (added later): {', '.join(comparison.unrecorded)}")


@app.command()
@handle_errors
def report(
    run: Annotated[Path, typer.Argument(help="An online run directory (`elm stream --out`), finished or not.")],
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Redraw the plots.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """The table (and plots) of an online run from its records, also while it is still running or after it
    stopped part-way: how many questions each method has answered so far is the table's n (loads no model)."""
    from elm_memory.errors import ConfigError
    from elm_memory.eval.online import finish
    from elm_memory.eval.progress import duration_text, time_left
    from elm_memory.eval.records import RecordLog

    manifest_path = run / "run.json"
    if not manifest_path.is_file():
        raise ConfigError(f"{run} is not an online run directory: no run.json (`elm stream --out DIR` writes one)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    methods = manifest.get("methods")
    if not methods:  # a run written before the manifest listed them: the order they appear in
        methods = list(dict.fromkeys(r["method"] for r in RecordLog(run / "records.jsonl").read()))
    result = finish(run, methods, plots=plots, config=manifest.get("config"))
    total = len(manifest.get("question_ids") or [])
    answered = {m: result.summary.get(m, {}).get("n", 0) for m in methods}
    short = [f"{m} {n}/{total}" for m, n in answered.items() if n < total]
    if short and not json_out:
        left = time_left(result.records, sum(total - n for n in answered.values()))
        pace = "" if left is None else f"; about {duration_text(left)} more at the pace of its last records"
        typer.echo(f"partial run: {', '.join(short)} questions answered{pace}")
    _print_run(result, json_out)
    from elm_memory.environment import mixed_code_warning

    if not json_out and (warning := mixed_code_warning(manifest.get("code_versions") or [])):
        typer.echo(f"warning: this run's {warning}")


@app.command()
@handle_errors
def offline(
    dataset: DatasetOpt,
    out: Annotated[Path, typer.Option(help="Run directory (records, summary, plots, memories). Re-run to resume.")],
    limit: Annotated[int | None, typer.Option(min=1, help="Questions in the set (after shuffling).")] = None,
    seed: Annotated[int | None, typer.Option(help="Order seed; the subset is the first --limit. Default 17.")] = 17,
    train: Annotated[
        int | None, typer.Option(min=1, help="Learn memories (or train the full model) on the first N questions only.")
    ] = None,
    memories_from: Annotated[
        Path | None, typer.Option(help="Evaluate the memories of another offline run (transfer).")
    ] = None,
    full_model: Annotated[
        bool,
        typer.Option(
            "--full-model",
            help="Instead of memories: train the whole model on the questions (paper's TTRL/GRPO rows, TRL's "
            "GRPOTrainer), then answer them greedily next to zero-shot. On a CPU only small models are feasible: "
            "above 300M parameters it is refused unless --force.",
        ),
    ] = False,
    reward: Annotated[
        str | None, typer.Option(help="--full-model: majority (TTRL, no ground truth; default) or gold (GRPO).")
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(min=1, help="--full-model: epochs over the questions (default 1; paper 10-80).")
    ] = None,
    full_model_lr: Annotated[
        float | None, typer.Option(help="--full-model: learning rate (default 1e-6, the paper's for the full model).")
    ] = None,
    save_model: Annotated[
        bool, typer.Option("--save-model", help="--full-model: keep the trained model (safetensors) in OUT/model.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="--full-model: train a model above the CPU size limit anyway.")
    ] = False,
    ablations: Annotated[
        bool,
        typer.Option(
            "--ablations",
            help="Run the paper's ablation variants (ELM, S=2 steps, SFT objective) on the same questions, each "
            "in OUT/<variant>, and write OUT/ablations.md.",
        ),
    ] = False,
    batch_size: Annotated[int, typer.Option(min=1, help="Questions per batched greedy call.")] = 8,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    no_plots: NoPlotsOpt = False,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
) -> None:
    """The paper's offline protocol: one memory per question, each evaluated on the whole set.

    ``--full-model`` runs the full-dataset baselines instead (TTRL, or GRPO with ``--reward gold``);
    ``--ablations`` runs the ablation variants side by side."""
    from elm_memory.data.datasets import load_problems

    full_model_options = {
        "--reward": reward is not None,
        "--epochs": epochs is not None,
        "--full-model-lr": full_model_lr is not None,
        "--save-model": save_model,
        "--force": force,
    }
    _check_offline_flags(full_model, ablations, memories_from is not None, full_model_options)
    cfg = load_config(config, preset, None, set_, backend, server_url)
    problems = load_problems(dataset, limit=limit, seed=seed)
    progress = None if not json_out else False
    files = "zero_shot.jsonl, memories.jsonl, evals.jsonl, summary.json, results.md"
    if full_model:
        from elm_memory.eval.full_model import run_full_model
        from elm_memory.training.full_model import FullModelSettings

        settings = FullModelSettings(
            epochs=epochs or 1,
            reward=reward or "majority",  # type: ignore[arg-type]  # checked by FullModelSettings
            learning_rate=full_model_lr if full_model_lr is not None else 1e-6,
        )
        result: Any = run_full_model(
            problems,
            cfg,
            out,
            settings=settings,
            dataset=dataset,
            seed=seed,
            train=train,
            save_model=save_model,
            force=force,
            batch_size=batch_size,
            progress=progress,
        )
        files = "zero_shot.jsonl, training.json, full_model.jsonl, summary.json, results.md"
    elif ablations:
        from elm_memory.eval.ablations import run_ablations

        result = run_ablations(
            problems,
            cfg,
            out,
            dataset=dataset,
            seed=seed,
            train=train,
            batch_size=batch_size,
            progress=progress,
            plots=not no_plots,
        )
        files = "ablations.md, ablations.json, one offline run per variant"
    else:
        from elm_memory.eval.offline import run_offline

        result = run_offline(
            problems,
            cfg,
            out,
            dataset=dataset,
            seed=seed,
            train=train,
            memories_from=memories_from,
            batch_size=batch_size,
            progress=progress,
            plots=not no_plots,
        )
    _print_run(result, json_out, files)


@app.command()
@handle_errors
def sweep(
    dataset: DatasetOpt,
    out: Annotated[Path, typer.Option(help="Sweep folder: one offline run per grid point, sweep.md, sweep.json.")],
    grid: Annotated[
        list[str],
        typer.Option(help="NAME=V1,V2 (repeatable): S, G, lr, k, cap, min_share, beta or a dotted config key."),
    ],
    questions: Annotated[int, typer.Option(min=1, help="Dev questions (outside the reported streams).")] = 12,
    per_family: Annotated[int, typer.Option(min=1, help="Dev questions per family (synth-arith).")] = 2,
    memories: Annotated[
        int | None, typer.Option(min=1, help="Memories learned per point (default: one per family).")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Questions per batched greedy call.")] = 8,
    dev_seed: Annotated[
        int | None,
        typer.Option(help="Seed of the dev questions' order (default 1234): another seed, another sample."),
    ] = None,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Training-recipe sweep: the offline protocol at every grid point, each memory measured on its own
    question, its family and unrelated questions against zero-shot and its untrained init."""
    from elm_memory.eval.sweep import sweep_from_cli

    cfg = load_config(config, preset, None, set_)
    result = sweep_from_cli(
        dataset,
        out,
        grid,
        cfg,
        questions=questions,
        per_family=per_family,
        memories=memories,
        batch_size=batch_size,
        dev_seed=dev_seed,
        progress=None if not json_out else False,
    )
    _print_run(result, json_out, "sweep.md, sweep.json, one offline run per point")


def _check_offline_flags(
    full_model: bool, ablations: bool, memories_from: bool, full_model_options: dict[str, bool]
) -> None:
    """``elm offline``'s modes exclude each other; full-model options need ``--full-model``."""
    from elm_memory.errors import ConfigError

    if full_model and ablations:
        raise ConfigError("--full-model and --ablations are two different runs; give one of them")
    if memories_from and (full_model or ablations):
        mode = "--full-model trains the model itself" if full_model else "--ablations learns each variant's memories"
        raise ConfigError(f"--memories-from evaluates another run's memories, but {mode}; drop one of them")
    given = [name for name, set_ in full_model_options.items() if set_]
    if given and not full_model:
        raise ConfigError(f"{', '.join(given)}: only used with --full-model")
