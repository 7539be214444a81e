"""``elm memories ...``: inspect and maintain a memory store without loading a model.

Every command finds its store as the model-running commands do: from ``--config``, ``--preset``
and ``--set`` (``store.path``, resolved by :mod:`elm_memory.store.location`), or ``--store PATH``.
Only importing a PEFT adapter loads the configured model (to rebuild the memory's keys).

Register in the main CLI with ``app.add_typer(memories_app, name="memories")``. Commands
raise typed :class:`~elm_memory.errors.ELMError` subclasses; each command is also
wrapped here so it prints one ``error: ...`` line when used on its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from elm_memory.cli_errors import handle_errors
from elm_memory.errors import ConfigError, StoreError

if TYPE_CHECKING:  # torch and chromadb load only when a command runs
    from elm_memory.config import ELMConfig
    from elm_memory.memory import LatentMemory
    from elm_memory.store.base import MemoryRecord
    from elm_memory.store.chroma import ChromaMemoryStore

memories_app = typer.Typer(
    help="Stored memories: list, show, stats, delete, evict, export, import, check (and repair).",
    no_args_is_help=True,
)

StoreOpt = Annotated[
    Optional[Path],
    typer.Option("--store", help="Store folder; overrides the config's store.path (see `elm config show`).",
                 show_default=False),
]  # fmt: skip
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file (its store.* is used).")]
PresetOpt = Annotated[
    Optional[str], typer.Option("--preset", "-p", help="Named preset, e.g. cpu-tiny (the store its commands use).")
]
SetOpt = Annotated[
    Optional[list[str]], typer.Option("--set", help="Override a config value: section.key=value (repeatable).")
]
UrlOpt = Annotated[Optional[str], typer.Option("--url", help="Chroma server URL (index rows there, blobs in --store).")]
NamespaceOpt = Annotated[Optional[str], typer.Option("--namespace", "-n", help="Only this namespace.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _load_config(
    config: Path | None, preset: str | None, sets: list[str] | None, store: Path | None, url: str | None
) -> ELMConfig:
    """The config every other command would use; ``--store`` (a path on this command line, so relative
    to the current directory like any other) and ``--url`` override its ``store`` section."""
    from elm_memory.config import ELMConfig, _deep_merge, parse_overrides

    overrides = parse_overrides(sets)
    if store is not None:
        overrides = _deep_merge(overrides, {"store": {"path": str(store.expanduser().absolute())}})
    if url is not None:
        overrides = _deep_merge(overrides, {"store": {"url": url}})
    return ELMConfig.load(config, preset=preset, overrides=overrides)


def _open(cfg: ELMConfig, *, create: bool = False) -> ChromaMemoryStore:
    from elm_memory.store.chroma import ChromaMemoryStore
    from elm_memory.store.location import LEGACY_STORE

    if cfg.store.kind != "chroma":
        raise StoreError(f"`elm memories` works on a chroma store; the config's store.kind is {cfg.store.kind!r}")
    path = Path(cfg.store.path)
    if cfg.store.url is None and not create and not (path / "chroma").is_dir():
        legacy = LEGACY_STORE.expanduser()
        hint = (
            f"; memories of an older version are in {legacy} (use --store {legacy}, or move it there)"
            if (legacy / "chroma").is_dir() and legacy != path
            else ""
        )
        raise StoreError(f"no memory store at {path} (pick one with --preset, --config, --set store.path=... "
                         f"or --store PATH){hint}")  # fmt: skip
    return ChromaMemoryStore.from_config(cfg.store)


def _prepared_models() -> dict[str, Any]:
    """Fingerprint -> ModelInfo of the models prepared on this machine, read from their folders
    (``elm_model.json`` and ``config.json``) without loading weights: what an import is checked against."""
    from types import SimpleNamespace

    from elm_memory.models.loading import ModelInfo
    from elm_memory.models.prepare import MARKER, elm_home

    out: dict[str, Any] = {}
    for marker in sorted((elm_home() / "models").glob(f"*/{MARKER}")):
        try:
            fingerprint = json.loads(marker.read_text(encoding="utf-8"))["embedding_fingerprint"]
            cfg = json.loads((marker.parent / "config.json").read_text(encoding="utf-8"))
            out[fingerprint] = ModelInfo.from_config(
                SimpleNamespace(**cfg), name=marker.parent.name, path=str(marker.parent),
                vocab_size=int(cfg.get("vocab_size", 0)), dtype="float32", device="cpu", fingerprint=fingerprint,
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a half-prepared or foreign folder: nothing to check against
    return out


def _export_path(out: Path, memory_id: str) -> Path:
    """``out/<id>.safetensors``, refusing an id that is not plain hex (a store written by an older
    version may hold one): an id must never name a file outside ``out``."""
    from elm_memory.store.names import validate_memory_id

    validate_memory_id(memory_id)
    path = out / f"{memory_id}.safetensors"
    if path.parent != out:  # cannot happen for hex; a second guard costs nothing
        raise StoreError(f"memory id {memory_id!r} does not name a file in {out}")
    return path


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "never"


def _memory_view(record: MemoryRecord, memory: LatentMemory) -> dict[str, Any]:
    from dataclasses import asdict

    sp = memory.soft_prompt
    return {
        "record": record.to_dict(),
        "meta": asdict(memory.meta),
        "soft_prompt": {"shape": list(sp.shape), "dtype": str(sp.dtype).removeprefix("torch."),
                        "norm_mean": float(sp.norm(dim=1).mean())},  # fmt: skip
        "keys": {k: {"dim": int(v.numel()), "norm": float(v.norm())} for k, v in memory.keys.items()},
    }


@memories_app.command("list")
@handle_errors
def list_(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    kind: Annotated[Optional[str], typer.Option(help="Only memories indexed by this key kind.")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="At most this many (oldest first).")] = None,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Memories in the store, oldest first (index rows only; no blob is opened)."""
    s = _open(_load_config(config, preset, set_, store, url))
    records = s.list(namespace, kind=kind, limit=limit, offset=offset)
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in records], ensure_ascii=False))
        return
    for r in records:
        flag = " no-consensus" if r.no_consensus else ""
        question = r.question.replace("\n", " ")
        typer.echo(f"{r.id}  {r.namespace:<12} {','.join(r.kinds):<22} used {r.usage:>4}  {_when(r.created_at)}"
                   f"{flag}  {question[:60]}")  # fmt: skip
    typer.echo(f"{len(records)} memories", err=True)


@memories_app.command("show")
@handle_errors
def show(
    memory_id: Annotated[str, typer.Argument(help="Memory id.")],
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """One memory: metadata, training statistics, usage, soft-prompt and key shapes (blob validated)."""
    s = _open(_load_config(config, preset, set_, store, url))
    record = s.record(memory_id, namespace)
    view = _memory_view(record, s.load(record))
    if json_out:
        typer.echo(json.dumps(view, ensure_ascii=False))
        return
    m, r = view["meta"], view["record"]
    typer.echo(f"id:         {m['id']}\nnamespace:  {m['namespace']}\nmodel:      {m['model_name']} "
               f"(fingerprint {m['model_fingerprint']}, hidden {m['hidden_size']})\n"
               f"created:    {_when(m['created_at'])}\nusage:      {r['usage']} (last {_when(r['last_used_at'])})\n"
               f"blob:       {r['blob']}\nsoft prompt: {view['soft_prompt']}\nkeys:       {view['keys']}\n"
               f"stats:      steps={m['stats']['steps']} majority={m['stats']['majority_answer']!r} "
               f"share={m['stats']['majority_share']:.2f} no_consensus={m['stats']['no_consensus']}\n"
               f"question:   {m['question']}")  # fmt: skip


@memories_app.command("delete")
@handle_errors
def delete(
    memory_ids: Annotated[Optional[list[str]], typer.Argument(help="Memory ids.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every memory of --namespace (and its indexes).")] = False,
    compact: Annotated[
        bool, typer.Option(help="After --all, VACUUM the embedded index so no freed page keeps deleted text.")
    ] = True,
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Delete memories: index rows, blob and utility counters (journalled; `check --repair` finishes an
    interrupted one). `--namespace NS --all` deletes a whole namespace."""
    from elm_memory.store.base import MemoryNotFoundError

    if all_ and (memory_ids or namespace is None):
        raise ConfigError("--all deletes a whole namespace: give --namespace NS and no ids")
    if not all_ and not memory_ids:
        raise ConfigError("give memory ids to delete, or --namespace NS --all")
    s = _open(_load_config(config, preset, set_, store, url))
    if all_:
        assert namespace is not None
        deleted = s.delete_namespace(namespace)
        compacted = compact and s.compact_index()
        if json_out:
            typer.echo(json.dumps({"deleted": deleted, "missing": [], "compacted": compacted}))
        else:
            typer.echo(f"deleted {len(deleted)} memories of namespace {namespace!r}")
            if compact and not compacted:
                typer.echo("note: the index was not compacted (a Chroma server, or another process was writing); "
                           "freed pages may keep deleted text until reused", err=True)  # fmt: skip
        return
    assert memory_ids is not None
    missing = [m for m in memory_ids if not s.delete(m, namespace)]
    if json_out:
        typer.echo(json.dumps({"deleted": [m for m in memory_ids if m not in missing], "missing": missing}))
    else:
        typer.echo(f"deleted {len(memory_ids) - len(missing)} memories")
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MemoryNotFoundError(f"no memory {missing[0]!r} in the store{more}")


SORT_KEYS = ("won", "lost", "retrieved", "utility")


@memories_app.command("stats")
@handle_errors
def stats(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    sort: Annotated[str, typer.Option(help="Highest first by: won, lost, retrieved or utility.")] = "retrieved",
    limit: Annotated[Optional[int], typer.Option(min=1, help="At most this many rows.")] = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Per-memory utility from the answer path: times used, agreed, won, lost, utility
    ((won + agreed) / (won + agreed + lost)), mean similarity when used, right/wrong against gold."""
    if sort not in SORT_KEYS:
        raise ConfigError(f"--sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
    s = _open(_load_config(config, preset, set_, store, url))
    rows = []
    for r in s.list(namespace):
        u = s.utility_of(r.namespace, [r.id]).get(r.id)
        counters = u.to_dict() if u is not None else {
            "retrieved": 0, "agreed": 0, "won": 0, "lost": 0, "observations": 0, "utility": None,
            "mean_similarity": None, "gold_right": 0, "gold_wrong": 0,
        }  # fmt: skip
        rows.append({
            "id": r.id, "namespace": r.namespace, "question": r.question, "created_at": r.created_at,
            "usage": r.usage, "last_used_at": r.last_used_at,
            **{k: counters[k] for k in ("retrieved", "agreed", "won", "lost", "observations", "utility",
                                        "mean_similarity", "gold_right", "gold_wrong")},
        })  # fmt: skip
    # highest first; a memory never judged (utility None) sorts last
    rows.sort(key=lambda x: (x[sort] is not None, x[sort] or 0, x["retrieved"]), reverse=True)
    rows = rows[:limit] if limit is not None else rows
    if json_out:
        typer.echo(json.dumps(rows, ensure_ascii=False))
        return
    typer.echo(f"{'id':<32}  {'namespace':<12} {'used':>5} {'agree':>5} {'won':>5} {'lost':>5} {'util':>5} "
               f"{'sim':>5} {'gold':>7}  question")  # fmt: skip
    for x in rows:
        util = "-" if x["utility"] is None else f"{x['utility']:.2f}"
        sim = "-" if x["mean_similarity"] is None else f"{x['mean_similarity']:.2f}"
        gold = f"{x['gold_right']}/{x['gold_right'] + x['gold_wrong']}"
        question = x["question"].replace("\n", " ")
        typer.echo(f"{x['id'][:32]:<32}  {x['namespace'][:12]:<12} {x['retrieved']:>5} {x['agreed']:>5} "
                   f"{x['won']:>5} {x['lost']:>5} {util:>5} {sim:>5} {gold:>7}  {question[:50]}")  # fmt: skip
    typer.echo(f"{len(rows)} memories", err=True)


@memories_app.command("evict")
@handle_errors
def evict(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    policy: Annotated[
        Optional[str], typer.Option(help="lru, utility or oldest (default: store.eviction).", show_default=False)
    ] = None,
    keep: Annotated[
        Optional[int], typer.Option(min=0, help="Memories kept per namespace (default: store.max_memories).",
                                    show_default=False)
    ] = None,  # fmt: skip
    expired: Annotated[bool, typer.Option("--expired", help="Remove memories older than store.ttl_days.")] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Remove expired memories (--expired) and/or evict down to --keep per namespace by --policy."""
    cfg = _load_config(config, preset, set_, store, url)
    if not expired and keep is None and cfg.store.max_memories is None:
        raise ConfigError("nothing to evict to: give --keep N (or set store.max_memories), or --expired")
    if expired and cfg.store.ttl_days is None:
        raise ConfigError("--expired needs store.ttl_days (e.g. --set store.ttl_days=30)")
    s = _open(cfg)
    out: dict[str, list[str]] = {"expired": [], "evicted": []}
    if expired:
        out["expired"] = s.expire(namespace)
    if keep is not None or cfg.store.max_memories is not None:
        out["evicted"] = s.evict(policy, keep, namespace)
    if json_out:
        typer.echo(json.dumps(out))
    else:
        typer.echo(f"expired {len(out['expired'])}, evicted {len(out['evicted'])} memories")


@memories_app.command("export")
@handle_errors
def export(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="[ID ...] OUT. OUT: a folder (one <id>.safetensors per memory) or, for one id, a file; "
            "with --format peft, the adapter folder (several memories: one subfolder per id).",
            metavar="[ID]... OUT",
            show_default=False,
        ),
    ],
    memory_ids: Annotated[Optional[list[str]], typer.Option("--id", help="Memory id (repeatable).")] = None,
    format_: Annotated[
        str, typer.Option("--format", help="`safetensors` (ELM memory files) or `peft` (prompt-tuning adapter).")
    ] = "safetensors",
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write memories as standalone safetensors files (what `elm memories import` reads), or as PEFT
    prompt-tuning adapters (`PeftModel.from_pretrained(base, OUT)`; prefix memories only)."""
    from elm_memory.store.base import MemoryNotFoundError

    if format_ not in ("safetensors", "peft"):
        raise ConfigError(f"--format must be safetensors or peft, got {format_!r}")
    out = Path(targets[-1])
    memory_ids = [*targets[:-1], *(memory_ids or [])]
    cfg = _load_config(config, preset, set_, store, url)
    s = _open(cfg)
    records = s.list(namespace)
    if memory_ids:
        wanted = set(memory_ids)
        records = [r for r in records if r.id in wanted]
        missing = wanted - {r.id for r in records}
        if missing:
            raise MemoryNotFoundError(f"no memory {sorted(missing)[0]!r} in the store")
    if format_ == "peft":
        written = _export_peft(s, records, out, cfg)
    else:
        single_file = len(records) == 1 and memory_ids and out.suffix == ".safetensors"
        paths = [out if single_file else _export_path(out, r.id) for r in records]  # all checked before writing
        written = []
        for r, path in zip(records, paths, strict=True):
            s.load(r).save(path)
            written.append(str(path))
    typer.echo(json.dumps({"written": written}) if json_out else f"exported {len(written)} memories to {out}")


def _export_peft(s: ChromaMemoryStore, records: list[MemoryRecord], out: Path, cfg: ELMConfig) -> list[str]:
    """One adapter folder per memory: ``out`` itself for one, ``out/<id>`` for several. Every memory is
    loaded and checked (prefix position) before the first folder is written."""
    from elm_memory.store.names import validate_memory_id
    from elm_memory.store.peft_adapter import export_adapter, memory_position, require_prefix

    memories = [s.load(r) for r in records]
    for m in memories:
        validate_memory_id(m.id)  # names a folder below
        require_prefix(m, memory_position(m, cfg.prompt.soft_prompt_position))
    models = _prepared_models()
    written = []
    for m in memories:
        folder = out if len(memories) == 1 else out / m.id
        info = models.get(m.meta.model_fingerprint)
        base = info.path if info is not None else m.meta.model_name
        written.append(str(export_adapter(m, folder, position="prefix", base_model=base)))
    return written


@memories_app.command("import")
@handle_errors
def import_(
    files: Annotated[
        list[Path],
        typer.Argument(help="Memory .safetensors files (with their keys), or PEFT adapter folders ELM exported."),
    ],
    store: StoreOpt = None,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Add exported memory files or PEFT adapters to the store (validated; filed under their own model and namespace).

    Refused, with nothing written: a malformed or oversized file, an id that is not hex or that
    another namespace or model already uses, shapes that disagree with the model (a model
    prepared on this machine, else what the store already indexed for it). An adapter folder is
    checked against the config (memory.num_tokens, prefix position, the model's hidden size and
    embedding fingerprint); its keys are rebuilt with retrieval.key, which loads the model."""
    from elm_memory.errors import AdapterError
    from elm_memory.memory import LatentMemory
    from elm_memory.store.peft_adapter import check_adapter, is_adapter_dir, read_adapter

    cfg = _load_config(config, preset, set_, store, url)
    memories, adapters = [], []
    for f in files:
        if is_adapter_dir(f):
            memory, _ = read_adapter(f)
            check_adapter(memory, f, cfg, None)  # cheap checks before the model loads
            adapters.append((f, memory))
        elif f.is_dir():
            raise AdapterError(f"{f} is a folder without adapter_config.json (not a PEFT adapter)")
        else:
            memories.append(LatentMemory.load(f))
    known = _prepared_models()
    if adapters:
        info = _rebuild_keys(adapters, cfg)
        known[info.fingerprint] = info
        memories += [m for _, m in adapters]
    s = _open(cfg, create=True)
    s.known_models = known
    s.put_many(memories)
    ids = [m.id for m in memories]
    typer.echo(json.dumps({"imported": ids}) if json_out else f"imported {len(ids)} memories")


def _rebuild_keys(adapters: list[tuple[Path, LatentMemory]], cfg: ELMConfig) -> Any:
    """Load the configured model, check each adapter against it and fill its keys with the configured
    key builder (what :class:`~elm_memory.retrieval.retriever.Retriever` files new memories with)."""
    import torch

    from elm_memory.models.loading import load_model
    from elm_memory.registry import key_builders
    from elm_memory.retrieval.retriever import tokenize_question
    from elm_memory.store.peft_adapter import check_adapter

    builder = key_builders.get(cfg.retrieval.key)()
    loaded = load_model(cfg.model)
    for folder, memory in adapters:
        check_adapter(memory, folder, cfg, loaded.info)
    memories = [m for _, m in adapters]
    ids = [tokenize_question(loaded.tokenizer, m.meta.question) for m in memories]
    keys = builder.memory_keys(loaded, [m.soft_prompt for m in memories], ids)
    for m, key in zip(memories, keys, strict=True):
        m.keys = {builder.kind: key.detach().to("cpu", torch.float32).contiguous()}
        m.validate()
    return loaded.info


@memories_app.command("check")
@handle_errors
def check(
    store: StoreOpt = None,
    url: UrlOpt = None,
    repair: Annotated[bool, typer.Option("--repair", help="Fix what is found (rebuild/drop rows, remove junk).")] = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also re-hash every blob.")] = False,
    grace: Annotated[float, typer.Option(help="Keep temp files younger than this many seconds.")] = 600.0,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Find blobs without index rows, rows without blobs, stale and corrupt files, interrupted deletes and
    counters of deleted memories; exit 1 if any remain unfixed."""
    s = _open(_load_config(config, preset, set_, store, url))
    report = s.check(repair=repair, deep=deep, temp_grace_seconds=grace)
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
    else:
        typer.echo(f"{report.memories} memories, {report.blobs} blobs, {report.rows} index rows")
        for name in ("reindexed", "orphan_rows", "superseded_blobs", "corrupt_blobs", "temp_files", "errors",
                     "empty_collections", "pending_deletes", "orphan_blobs", "orphan_utility"):  # fmt: skip
            items = getattr(report, name)
            if items:
                verb = "fixed" if repair else "found"
                typer.echo(f"  {name.replace('_', ' ')}: {len(items)} {verb}  ({', '.join(map(str, items[:3]))}"
                           f"{', ...' if len(items) > 3 else ''})")  # fmt: skip
        if report.ok:
            typer.echo("ok")
        elif repair:
            typer.echo("repair incomplete (see errors)" if report.errors else "repaired")
        else:
            typer.echo("problems found; run with --repair")
    if not report.ok and (not repair or report.errors):
        raise typer.Exit(1)
