"""A training-recipe sweep with the offline protocol as its inner loop (``elm sweep``).

Each point of a grid (S, G, lr, k, rollout cap, the weak-majority skip, or any dotted config key) is
one offline run (:mod:`elm_memory.eval.offline`) on the same dev questions, in its own folder of the
sweep folder (each resumable). For every memory and every question it was evaluated on, the sweep
asks three questions, separately for the memory's **own** question, its **family** (same synth-arith
template, another question) and **unrelated** questions:

* is it right more often than zero-shot on the same questions?
* is it right more often than its **untrained init** (the same memory at S = 0, its own run: the
  question-initialised soft prompt with the point's k) on the same (memory, question) pairs?
* how far did training move it (relative L2 distance from the init), and how much did its rollouts
  agree (the last step's majority share)?
* on its own question, did training make its rollouts right more often (first step against last, read
  from the recorded training votes against the gold answer)?

Gains and losses are counted per (memory, question) pair with an exact sign test; the pairs of one
memory are not independent, so read p as a rough guide on a handful of memories.

Dev questions (:func:`dev_problems`) leave out the first ``held_out_first`` questions of every stream
seed the online results report on, so a recipe is never chosen on the questions it is judged on.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elm_memory.answers import equivalent
from elm_memory.config import ELMConfig
from elm_memory.data.datasets import Problem, load_problems
from elm_memory.errors import ConfigError
from elm_memory.eval.ablations import SharedBackend, Variant, variant_config
from elm_memory.eval.records import RecordLog, run_dir, write_json_atomic
from elm_memory.eval.significance import sign_test

#: short names of the swept settings (any dotted config key works too)
SETTINGS: dict[str, str] = {
    "S": "training.steps",
    "G": "training.num_generations",
    "lr": "training.learning_rate",
    "k": "memory.num_tokens",
    "cap": "training.max_completion_length",
    "min_share": "training.skip_below_majority_share",
    "beta": "training.beta",
}
#: what the untrained init of a point keeps from it: the settings its initial soft prompt depends on
_INIT_KEYS = ("memory.", "training.seed", "model.", "prompt.")
#: the stream seeds the online results report on: their first questions are never dev questions
REPORTED_SEEDS = (5, 17, 42, 78, 101, 202)
SCOPES = ("own", "family", "unrelated")
#: the default order of the dev questions (``elm sweep --dev-seed``)
DEV_SEED = 1234


@dataclass(frozen=True)
class SweepPoint:
    """One grid point: its folder name, the overrides it applies, and the grid's values for the table."""

    name: str
    overrides: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    table: str
    summary: dict[str, Any]
    plots: list[Path] = field(default_factory=list)


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["S=0,1,4", "lr=1e-4,1e-2"]`` -> ``{"S": [0, 1, 4], "lr": [0.0001, 0.01]}``; a name that is neither
    a short setting (:data:`SETTINGS`) nor a dotted config key is refused here, before any model loads."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise ConfigError(f"sweep grid entry {spec!r} is not NAME=V1,V2,... (e.g. S=0,1,4)")
        if name not in SETTINGS and "." not in name:
            raise ConfigError(
                f"unknown sweep setting {name!r}: use one of {', '.join(SETTINGS)} or a dotted config key"
            )
        if name in grid:
            raise ConfigError(f"sweep setting {name!r} is given twice")
        grid[name] = [_value(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise ConfigError("the sweep grid is empty: give at least one --grid NAME=V1,V2")
    return grid


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[SweepPoint]:
    """Every combination of the grid's values, in the order given."""
    names = list(grid)
    points = []
    for values in itertools.product(*(grid[n] for n in names)):
        settings = dict(zip(names, values, strict=True))
        overrides = {SETTINGS.get(n, n): v for n, v in settings.items()}
        label = "-".join(f"{n}{v}" for n, v in settings.items()).replace("/", "_")
        points.append(SweepPoint(name=label or "base", overrides=overrides, settings=settings))
    return points


def init_point(point: SweepPoint) -> SweepPoint:
    """The untrained init of ``point``: S = 0 with only the settings its initial memory depends on."""
    kept = {k: v for k, v in point.overrides.items() if k.startswith(_INIT_KEYS)}
    label = "-".join(f"{k.split('.')[-1]}{v}" for k, v in kept.items())
    return SweepPoint(name="init" + (f"-{label}" if label else ""), overrides={**kept, "training.steps": 0})


def dev_problems(
    dataset: str,
    questions: int,
    *,
    per_family: int = 2,
    seed: int = DEV_SEED,
    held_out_seeds: Sequence[int] = REPORTED_SEEDS,
    held_out_first: int = 60,
) -> list[Problem]:
    """``questions`` dev questions of ``dataset`` outside the first ``held_out_first`` of every stream in
    ``held_out_seeds``. With families (synth-arith): ``per_family`` questions from each of
    ``questions // per_family`` families, the first of each family first (the memories' sources)."""
    if questions < 1 or per_family < 1:
        raise ConfigError("a sweep needs at least one dev question and per_family >= 1")
    held_out = {p.id for s in held_out_seeds for p in load_problems(dataset, limit=held_out_first, seed=s)}
    pool = [p for p in load_problems(dataset) if p.id not in held_out]
    random.Random(seed).shuffle(pool)
    if all(p.family is None for p in pool):
        if len(pool) < questions:
            raise ConfigError(f"{dataset} has only {len(pool)} questions outside the reported streams")
        return pool[:questions]
    families: dict[str, list[Problem]] = {}
    for p in pool:
        families.setdefault(str(p.family), []).append(p)
    chosen = [f for f, members in families.items() if len(members) >= per_family][: questions // per_family]
    if len(chosen) * per_family < questions:
        raise ConfigError(f"{dataset} has too few families with {per_family} dev questions for {questions} questions")
    return [families[f][i] for i in range(per_family) for f in chosen]


def check_points(config: ELMConfig, points: Sequence[SweepPoint]) -> list[ELMConfig]:
    """Every point's config, built before any model loads: an unknown key or bad value fails here."""
    configs = []
    for point in points:
        try:
            configs.append(variant_config(config, Variant(point.name, point.name, point.overrides)))
        except ConfigError as exc:
            raise ConfigError(f"sweep point {point.name}: {exc}") from None
    return configs


def run_sweep(
    problems: Sequence[Problem],
    config: ELMConfig,
    out_dir: str | Path,
    grid: Mapping[str, Sequence[Any]],
    *,
    memories: int | None = None,
    dataset: str = "custom",
    batch_size: int = 8,
    loaded: Any = None,
    backend: Any = None,
    progress: bool | None = None,
) -> SweepResult:
    """Each grid point's offline run (memories from the first ``memories`` questions, each evaluated on
    all), plus the untrained init of each distinct memory setting; then ``sweep.md`` and ``sweep.json``."""
    from elm_memory.eval.methods.base import EvalRuntime
    from elm_memory.eval.offline import run_offline

    out = run_dir(out_dir)
    if not problems:
        raise ConfigError("no questions to sweep over")
    points = grid_points(grid)
    inits = list({p.name: p for p in (init_point(x) for x in points)}.values())
    configs = check_points(config, inits + points)
    runs = list(zip(inits + points, configs, strict=True))
    shared = SharedBackend(config, loaded, backend)
    started, finished = time.monotonic(), 0
    try:
        for i, (point, cfg) in enumerate(runs, 1):
            if finished:
                left = (time.monotonic() - started) / finished * (len(runs) - i + 1)
                eta = f", about {left / 60:.0f} min left at this pace"
            else:
                eta = ""
            _say(progress, f"[sweep] point {i}/{len(runs)}: {point.name}{eta}")
            sub = out / point.name
            run_offline(
                problems,
                cfg,
                sub,
                dataset=dataset,
                seed=None,
                train=memories,
                batch_size=batch_size,
                runtime=EvalRuntime(cfg, sub, backend=shared),
                progress=progress,
                plots=False,
            )
            finished += 1
        info = _model_info(shared)
    finally:
        shared.close()
    rows = [sweep_row(out, p, init_point(p), problems, info) for p in points]
    summary = {
        "dataset": dataset,
        "question_ids": [p.id for p in problems],
        "memories": memories or len(problems),
        "grid": {k: list(v) for k, v in grid.items()},
        "rows": rows,
    }
    table = markdown_sweep(rows)
    write_json_atomic(out / "sweep.json", summary)
    (out / "sweep.md").write_text(table, encoding="utf-8")
    return SweepResult(out_dir=out, rows=rows, table=table, summary=summary)


def _say(progress: bool | None, line: str) -> None:
    import sys

    if progress is not False:
        print(line, file=sys.stderr, flush=True)


def _model_info(shared: Any) -> Any:
    try:
        return shared.loaded.info
    except Exception:  # a backend without a loaded model (a server): no distances, the rest stands
        return None


def sweep_row(
    out: Path, point: SweepPoint, init: SweepPoint, problems: Sequence[Problem], info: Any = None
) -> dict[str, Any]:
    """One point's measurements per scope, from its run's files and its init's (loads no model)."""
    family = {p.id: p.family for p in problems}
    zs = {r["question_id"]: bool(r["correct"]) for r in RecordLog(out / point.name / "zero_shot.jsonl").read()}
    evals = _evals(out / point.name)
    base = _evals(out / init.name)
    mems = RecordLog(out / point.name / "memories.jsonl").read()
    row: dict[str, Any] = {
        "point": point.name,
        "settings": point.settings,
        "memories": len(mems),
        "mean_majority_share": _mean([m.get("majority_share") for m in mems]),
        "updated_steps": sum(not skipped for m in mems for skipped in m.get("skipped_backward") or []),
        "learn_seconds_mean": _mean([m.get("seconds") for m in mems]),
        "relative_move": _relative_move(out, point, init, info),
        "own_rollouts": own_rollouts(mems, {p.id: p.answer for p in problems}),
    }
    for scope in SCOPES:
        pairs = [key for key in evals if _scope(key, family) == scope and key[1] in zs]
        row[scope] = _compare(pairs, evals, zs, base)
    return row


def own_rollouts(memories: Sequence[Mapping[str, Any]], gold: Mapping[str, str]) -> dict[str, Any] | None:
    """Learning on the memory's own question, read from its training votes (no generation): the share of
    rollouts whose answer is the gold answer, and the mean TTRL reward, at the first step (the untrained
    init's rollouts) and the last (after the updates before it), pooled over the memories. ``None``
    without recorded votes (S = 0)."""
    first, last = [0, 0], [0, 0]  # [right, rollouts]
    rewards: tuple[list[float], list[float]] = ([], [])
    for m in memories:
        votes, answer = m.get("votes") or [], gold.get(str(m.get("question_id")))
        if not votes or answer is None:
            continue
        for tally, step in ((first, votes[0]), (last, votes[-1])):
            tally[0] += sum(int(n) for a, n in step if equivalent(a, answer))
            tally[1] += sum(int(n) for _, n in step)
        mean_reward = m.get("mean_reward") or []
        if mean_reward:
            rewards[0].append(float(mean_reward[0]))
            rewards[1].append(float(mean_reward[-1]))
    if not first[1]:
        return None
    return {
        "rollouts_first": first[1],
        "right_first": first[0] / first[1],
        "rollouts_last": last[1],
        "right_last": last[0] / last[1] if last[1] else None,
        "reward_first": _mean(rewards[0]),
        "reward_last": _mean(rewards[1]),
    }


def _evals(sub: Path) -> dict[tuple[str, str], bool]:
    """(source question, question) -> right, from an offline run's evals."""
    return {
        (r["source_question_id"], r["question_id"]): bool(r["correct"]) for r in RecordLog(sub / "evals.jsonl").read()
    }


def _scope(key: tuple[str, str], family: Mapping[str, str | None]) -> str:
    source, question = key
    if source == question:
        return "own"
    f = family.get(source)
    return "family" if f is not None and f == family.get(question) else "unrelated"


def _compare(
    pairs: list[tuple[str, str]], evals: Mapping[tuple[str, str], bool], zs: Mapping[str, bool], base: Mapping
) -> dict[str, Any]:
    if not pairs:
        return {"n": 0}
    mine = [evals[k] for k in pairs]
    theirs = [zs[k[1]] for k in pairs]
    out: dict[str, Any] = {
        "n": len(pairs),
        "memory_correct": sum(mine),
        "zero_shot_correct": sum(theirs),
        **_wins("vs_zero_shot", mine, theirs),
    }
    with_init = [k for k in pairs if k in base]
    if with_init:
        out["init_n"] = len(with_init)
        out["init_correct"] = sum(base[k] for k in with_init)
        out.update(_wins("vs_init", [evals[k] for k in with_init], [base[k] for k in with_init]))
    return out


def _wins(name: str, mine: Sequence[bool], theirs: Sequence[bool]) -> dict[str, Any]:
    wins = sum(a and not b for a, b in zip(mine, theirs, strict=True))
    losses = sum(b and not a for a, b in zip(mine, theirs, strict=True))
    return {name: {"gains": wins, "losses": losses, "p": sign_test(wins, losses)}}


def _mean(values: Sequence[Any]) -> float | None:
    got = [float(v) for v in values if isinstance(v, int | float)]
    return sum(got) / len(got) if got else None


def _relative_move(out: Path, point: SweepPoint, init: SweepPoint, info: Any) -> float | None:
    """Mean over the point's memories of |memory - init| / |init| (soft prompts; None when not measurable)."""
    if info is None or point.name == init.name:
        return 0.0 if point.name == init.name else None
    try:
        trained, untrained = _soft_prompts(out / point.name, info), _soft_prompts(out / init.name, info)
    except Exception:  # another memory kind, a missing store: the other measurements stand
        return None
    moves = []
    for question_id, soft in trained.items():
        base = untrained.get(question_id)
        if base is not None and float(base.norm()) > 0:
            moves.append(float((soft - base).norm() / base.norm()))
    return sum(moves) / len(moves) if moves else None


def _soft_prompts(sub: Path, info: Any) -> dict[str, Any]:
    import json

    from elm_memory.eval.offline import NAMESPACE
    from elm_memory.store.registry import stores

    cfg = ELMConfig.from_dict(json.loads((sub / "run.json").read_text(encoding="utf-8"))["config"])
    store_cfg = cfg.store.model_copy(update={"path": str(sub / "store")})
    store = stores.get(store_cfg.kind).from_config(store_cfg, model=info)
    ids = {r["memory_id"]: r["question_id"] for r in RecordLog(sub / "memories.jsonl").read()}
    return {q: store.get(mid, NAMESPACE).soft_prompt.float() for mid, q in ids.items()}


def markdown_sweep(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per (point, scope): the memory's accuracy next to zero-shot's and its init's on the same
    pairs, with gains/losses against each."""
    lines = [
        "| point | scope | pairs | memory | zero-shot | init | vs zero-shot (p) | vs init (p) "
        "| majority share | moved | learn s | own rollouts right, first → last step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        for scope in SCOPES:
            c = row[scope]
            if not c.get("n"):
                continue
            n = c["n"]
            init = f"{c['init_correct']}/{c['init_n']}" if "init_n" in c else "n/a"
            vs_init = _versus(c.get("vs_init"))
            lines.append(
                f"| {row['point']} | {scope} | {n} | {c['memory_correct']}/{n} | {c['zero_shot_correct']}/{n} "
                f"| {init} | {_versus(c['vs_zero_shot'])} | {vs_init} | {_fmt(row['mean_majority_share'], 2)} "
                f"| {_fmt(row['relative_move'], 4)} | {_fmt(row['learn_seconds_mean'], 0)} "
                f"| {_rollouts(row.get('own_rollouts')) if scope == 'own' else ''} |"
            )
    return "\n".join(lines) + "\n"


def _rollouts(r: Mapping[str, Any] | None) -> str:
    if not r:
        return "n/a"
    return f"{_fmt(r['right_first'], 2)} → {_fmt(r['right_last'], 2)} of {r['rollouts_first']} a step"


def _versus(w: Mapping[str, Any] | None) -> str:
    return "n/a" if w is None else f"+{w['gains']}/−{w['losses']} ({w['p']:.2g})"


def _fmt(x: float | None, digits: int) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def sweep_from_cli(
    dataset: str,
    out: Path,
    grid_specs: Sequence[str],
    config: ELMConfig,
    *,
    questions: int,
    per_family: int,
    memories: int | None,
    batch_size: int,
    progress: bool | None,
    dev_seed: int | None = None,
) -> SweepResult:
    """What ``elm sweep`` runs: the grid and every point's config are checked, then the dev questions
    chosen, before the model loads. Memories default to one per family (the first dev questions)."""
    grid = parse_grid(grid_specs)
    points = grid_points(grid)
    check_points(config, [init_point(p) for p in points] + points)
    problems = dev_problems(dataset, questions, per_family=per_family, seed=DEV_SEED if dev_seed is None else dev_seed)
    if memories is None:
        has_families = any(p.family is not None for p in problems)
        memories = max(1, questions // per_family) if has_families else len(problems)
    if not 1 <= memories <= len(problems):
        raise ConfigError(f"--memories must be between 1 and the {len(problems)} dev questions, got {memories}")
    return run_sweep(
        problems, config, out, grid, memories=memories, dataset=dataset, batch_size=batch_size, progress=progress
    )
