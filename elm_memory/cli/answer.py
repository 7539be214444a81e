"""``elm solve`` and ``elm learn``: answer one question; learn memories from questions."""

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
    NamespaceOpt,
    PresetOpt,
    QuestionCommand,
    ServerUrlOpt,
    SetOpt,
    load_config,
)
from elm_memory.memory.ids import short_id


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
    from elm_memory.backends.prompting import validate_question
    from elm_memory.elm import ELM

    validate_question(question)
    cfg = load_config(config, preset, namespace, set_, backend, server_url)
    with ELM(cfg) as elm:
        result = elm.answer(question, namespace=cfg.namespace, learn=not no_learn)
    if json_out:
        typer.echo(json.dumps(result.to_dict(), ensure_ascii=False))
        return
    typer.echo(result.response.strip())
    memory = f", memory {short_id(result.memory_id)} (sim {result.similarity:.3f})" if result.memory_id else ""
    typer.echo(f"\nanswer: {result.answer}   (route: {result.route}{memory}, {result.timings['total']:.1f} s)")
    turn = getattr(result, "stream_turn", None)
    if turn:  # a stream memory answered: how, and what it cost
        typer.echo(
            f"stream memory: {turn['mode']}, gate {turn['gate']}, version {turn['version']}, "
            f"{turn['tokens']} tokens generated"
        )
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    job = result.learn_job or {}
    if job.get("reused"):
        typer.echo(
            f"note: this question was learned before: reused its memory {short_id(job['memory_id'] or '')}, "
            "no new memory learned",
            err=True,
        )


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
