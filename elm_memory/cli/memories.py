"""``elm memories ...``: inspect and maintain a memory store without loading a model.

Every command finds its store as the model-running commands do: from ``--config``, ``--preset``
and ``--set`` (``store.path``, resolved by :mod:`elm_memory.config.location`), or ``--store PATH``.
Only importing a PEFT adapter loads the configured model (to rebuild the memory's keys).
Tables show ids by their first 12 characters; a command that takes ids resolves each unique prefix in the
store (:meth:`~elm_memory.store.base.MemoryStoreBase.resolve_ids`); ``--json`` prints full ids.

Register in the main CLI with ``app.add_typer(memories_app, name="memories")``. Commands
raise typed :class:`~elm_memory.errors.ELMError` subclasses; each command is also
wrapped here so it prints one ``error: ...`` line when used on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from elm_memory.cli import memory_views as views
from elm_memory.cli.errors import handle_errors
from elm_memory.cli.memory_options import (
    ConfigOpt,
    JsonOpt,
    NamespaceOpt,
    PresetOpt,
    SetOpt,
    StoreOpt,
    UrlOpt,
    load_config,
    open_store,
)
from elm_memory.errors import ConfigError
from elm_memory.faults import point

if TYPE_CHECKING:  # torch and chromadb load only when a command runs
    from elm_memory.config import ELMConfig

memories_app = typer.Typer(
    help=(
        "Stored memories: list, streams, show, stats, delete, evict, merge, compact, export, import, check "
        "(and repair).\n\nTables show each memory id by its first 12 characters; show, delete and export take "
        "any unique start of an id (4 or more characters). --json prints full ids, for scripts."
    ),
    no_args_is_help=True,
)
_ID_HELP = "Memory id, or its first 4 or more characters (unique in the store)."


@memories_app.command("list")
@handle_errors
def list_(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    kind: Annotated[str | None, typer.Option(help="Only memories indexed by this key kind.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many (oldest first).")] = None,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Memories in the store, oldest first (index rows only; no blob is opened)."""
    s = open_store(load_config(config, preset, set_, store, url))
    records = s.list(namespace, kind=kind, limit=limit, offset=offset)
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in records], ensure_ascii=False))
        return
    for line in views.list_table(records):
        typer.echo(line)
    typer.echo(f"{len(records)} memories", err=True)


@memories_app.command("streams")
@handle_errors
def streams(
    store: StoreOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Stream memories (stream.mode stream or both): per namespace, the serving version, updates, rollbacks, gate.

    Each version is a memory file (LatentMemory.load reads it); history.jsonl beside the versions names every
    update, rollback and gate decision. With stream.serving amortized, each gate decision is listed under its row."""
    from elm_memory.cli.memory_views import stream_lines
    from elm_memory.retrieval.stream_clusters import belongs_to
    from elm_memory.store.stream_files import list_streams, stream_root

    cfg = load_config(config, preset, set_, store, None)
    root = stream_root(cfg.store.path)
    found = [s for s in list_streams(root) if namespace is None or belongs_to(s["namespace"], namespace)]
    if json_out:
        typer.echo(json.dumps(found, ensure_ascii=False))
        return
    for line in stream_lines(found):
        typer.echo(line)
    typer.echo(f"{len(found)} stream memories", err=True)


@memories_app.command("show")
@handle_errors
def show(
    memory_id: Annotated[str, typer.Argument(help=_ID_HELP)],
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """One memory: metadata, training statistics, usage, soft-prompt and key shapes (blob validated)."""
    s = open_store(load_config(config, preset, set_, store, url))
    record = s.record(s.resolve_id(memory_id, namespace), namespace)
    view = views.memory_view(record, s.load(record))
    typer.echo(json.dumps(view, ensure_ascii=False) if json_out else views.memory_text(view))


@memories_app.command("delete")
@handle_errors
def delete(
    memory_ids: Annotated[list[str] | None, typer.Argument(help=_ID_HELP, show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every memory of --namespace (and its indexes).")] = False,
    stream: Annotated[
        bool, typer.Option("--stream", help="The stream memory of --namespace, every version (it starts again).")
    ] = False,
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
    """Delete memories: index rows, blob and utility counters (journalled: check --repair finishes one).

    --namespace NS --all deletes a whole namespace; --namespace NS --stream deletes its stream memory and
    its clusters' (every version; its next learner starts again from the untrained memory)."""
    from elm_memory.store.base import MemoryNotFoundError

    if stream:
        if memory_ids or all_ or namespace is None:
            raise ConfigError("--stream deletes one namespace's stream memory: give --namespace NS, no ids, no --all")
        from elm_memory.retrieval.stream_clusters import delete_streams
        from elm_memory.store.stream_files import stream_root

        root = stream_root(load_config(config, preset, set_, store, url).store.path)
        removed = delete_streams(root, namespace)  # its clusters' stream memories too (stream.tuning.clusters > 1)
        typer.echo(json.dumps({"deleted_versions": removed}) if json_out else f"deleted {len(removed)} versions")
        return
    if all_ and (memory_ids or namespace is None):
        raise ConfigError("--all deletes a whole namespace: give --namespace NS and no ids")
    if not all_ and not memory_ids:
        raise ConfigError("give memory ids to delete, or --namespace NS --all")
    s = open_store(load_config(config, preset, set_, store, url))
    if all_:
        assert namespace is not None
        deleted = s.delete_namespace(namespace)
        compacted = compact and s.compact_index()
        if json_out:
            typer.echo(json.dumps({"deleted": deleted, "missing": [], "compacted": compacted}))
        else:
            typer.echo(f"deleted {len(deleted)} memories of namespace {namespace!r}")
            if compact and not compacted:
                typer.echo(
                    "note: the index was not compacted (a Chroma server, or another process was writing); "
                    "freed pages may keep deleted text until reused",
                    err=True,
                )
        return
    assert memory_ids is not None
    pairs = list(zip(memory_ids, s.resolve_ids(memory_ids, namespace, missing_ok=True), strict=True))
    deleted = [full for _, full in pairs if full is not None and s.delete(full, namespace)]  # none if ambiguous
    missing = [m for m, full in pairs if full not in deleted]
    if json_out:
        typer.echo(json.dumps({"deleted": deleted, "missing": missing}))
    else:
        typer.echo(f"deleted {len(deleted)} memories")
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MemoryNotFoundError(f"no memory {missing[0]!r} in the store{more}")


@memories_app.command("stats")
@handle_errors
def stats(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    sort: Annotated[str, typer.Option(help="Highest first by: won, lost, retrieved or utility.")] = "retrieved",
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many rows.")] = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Per-memory utility from the answer path: times used, agreed, won, lost, utility, similarity, gold.

    utility is (won + agreed) / (won + agreed + lost); sim the mean similarity when used; gold the answers
    right against a gold answer, of those judged (evaluation runs)."""
    if sort not in views.SORT_KEYS:
        raise ConfigError(f"--sort must be one of {', '.join(views.SORT_KEYS)}, got {sort!r}")
    s = open_store(load_config(config, preset, set_, store, url))
    rows = views.sort_stats(
        [views.stats_row(r, s.utility_of(r.namespace, [r.id]).get(r.id)) for r in s.list(namespace)], sort, limit
    )
    if json_out:
        typer.echo(json.dumps(rows, ensure_ascii=False))
        return
    for line in views.stats_table(rows):
        typer.echo(line)
    typer.echo(f"{len(rows)} memories", err=True)


@memories_app.command("evict")
@handle_errors
def evict(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    policy: Annotated[
        str | None, typer.Option(help="lru, utility or oldest (default: store.eviction).", show_default=False)
    ] = None,
    keep: Annotated[
        int | None,
        typer.Option(min=0, help="Memories kept per namespace (default: store.max_memories).", show_default=False),
    ] = None,
    expired: Annotated[bool, typer.Option("--expired", help="Remove memories older than store.ttl_days.")] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Remove expired memories (--expired) and/or evict down to --keep per namespace by --policy."""
    cfg = load_config(config, preset, set_, store, url)
    if not expired and keep is None and cfg.store.max_memories is None:
        raise ConfigError("nothing to evict to: give --keep N (or set store.max_memories), or --expired")
    if expired and cfg.store.ttl_days is None:
        raise ConfigError("--expired needs store.ttl_days (e.g. --set store.ttl_days=30)")
    s = open_store(cfg)
    out: dict[str, list[str]] = {"expired": [], "evicted": []}
    if expired:
        out["expired"] = s.expire(namespace)
    if keep is not None or cfg.store.max_memories is not None:
        out["evicted"] = s.evict(policy, keep, namespace)
    if json_out:
        typer.echo(json.dumps(out))
    else:
        typer.echo(f"expired {len(out['expired'])}, evicted {len(out['evicted'])} memories")


@memories_app.command("compact")
@handle_errors
def compact(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Rewrite the index collections with their live rows, then VACUUM the embedded index.

    HNSW keeps every deleted entry and searches through it, so after a large eviction queries are no
    faster until the index is rebuilt."""
    s = open_store(load_config(config, preset, set_, store, url))
    rows = s.rebuild_index(namespace)
    compacted = s.compact_index()
    if json_out:
        typer.echo(json.dumps({"rows": rows, "compacted": compacted}))
    else:
        typer.echo(f"rebuilt the index with {rows} rows" + ("" if compacted else " (not VACUUMed)"))


@memories_app.command("merge")
@handle_errors
def merge(
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    threshold: Annotated[
        float | None,
        typer.Option(
            help="Cosine of two keys at or above which they are near-duplicates (default 0.99).", show_default=False
        ),
    ] = None,
    strategy: Annotated[
        str,
        typer.Option(
            help="average (mean soft prompt) or train (brief GRPO on the members' questions; loads the model)."
        ),
    ] = "average",
    kind: Annotated[
        str | None, typer.Option(help="Key kind compared (default: retrieval.key).", show_default=False)
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="GRPO steps of a train merge.")] = 2,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the clusters; change nothing.")] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Join near-duplicate memories (keys at or above --threshold) into one memory each.

    Only memories of one model and namespace are compared. The merged memory names its members
    (merged_from); their counters are summed into it, then they are deleted."""
    from elm_memory.store.merge import DEFAULT_THRESHOLD, STRATEGIES, average_memory, find_clusters, merge_clusters

    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    cfg = load_config(config, preset, set_, store, url)
    s = open_store(cfg)
    clusters = find_clusters(
        s,
        namespace=namespace,
        kind=kind or cfg.retrieval.key,
        threshold=DEFAULT_THRESHOLD if threshold is None else threshold,
    )
    questions = {r.id: r.question for r in s.list(namespace)} if clusters and not json_out else {}
    merged: dict[tuple[str, ...], str] = {}
    if clusters and not dry_run:
        build = _train_builder(cfg, steps) if strategy == "train" else average_memory
        outcomes = merge_clusters(s, clusters, build)
        merged = {o.cluster.ids: o.merged_id for o in outcomes}
    if json_out:
        out = [{**c.to_dict(), "ids": list(c.ids), "merged_id": merged.get(c.ids)} for c in clusters]
        typer.echo(json.dumps({"clusters": out, "dry_run": dry_run, "strategy": strategy}))
        return
    for c in clusters:
        for line in views.merge_lines(c.to_dict(), questions, merged.get(c.ids)):
            typer.echo(line)
    verb = "would merge" if dry_run else "merged"
    typer.echo(f"{verb} {sum(len(c.ids) for c in clusters)} memories into {len(clusters)}", err=True)


def _train_builder(cfg: ELMConfig, steps: int) -> Any:
    """The ``train`` strategy's builder: the configured model, backend and prompts, loaded once."""
    from elm_memory.elm import ELM
    from elm_memory.training.merging import train_merged

    elm = ELM(cfg)

    def build(members: Any) -> Any:
        return train_merged(
            members, config=cfg, loaded=elm.loaded, backend=elm.backend, prompts=elm.prompts, steps=steps
        )

    return build


@memories_app.command("export")
@handle_errors
def export(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="[ID ...] OUT. ID: a memory id or its first 4 or more characters. OUT: a folder (one "
            "<id>.safetensors per memory, full ids) or, for one id, a file; "
            "with --format peft, the adapter folder (several memories: one subfolder per id).",
            metavar="[ID]... OUT",
            show_default=False,
        ),
    ],
    memory_ids: Annotated[list[str] | None, typer.Option("--id", help=f"{_ID_HELP} Repeatable.")] = None,
    format_: Annotated[
        str, typer.Option("--format", help="safetensors (ELM memory files) or peft (a prompt-tuning adapter).")
    ] = "safetensors",
    stream: Annotated[
        bool,
        typer.Option(
            "--stream", help="Export the stream memory of --namespace (default: default) instead of stored memories."
        ),
    ] = False,
    version: Annotated[
        int | None, typer.Option(help="With --stream: this version (default: the one that serves).", min=0)
    ] = None,
    store: StoreOpt = None,
    url: UrlOpt = None,
    namespace: NamespaceOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write memories as standalone safetensors files, or as PEFT prompt-tuning adapters.

    The files are what elm memories import reads. An adapter folder loads with
    PeftModel.from_pretrained(base, OUT) (prefix memories only)."""
    from elm_memory.store import transfer

    if format_ not in ("safetensors", "peft"):
        raise ConfigError(f"--format must be safetensors or peft, got {format_!r}")
    out = Path(targets[-1])
    memory_ids = [*targets[:-1], *(memory_ids or [])]
    cfg = load_config(config, preset, set_, store, url)
    if stream or version is not None:
        if memory_ids or not stream:
            raise ConfigError(
                "--stream exports one stream memory: give OUT and --namespace, no ids; --version needs it"
            )
        path = transfer.export_stream(cfg, namespace or cfg.namespace, version, out, format_)
        typer.echo(json.dumps({"written": [path]}) if json_out else f"exported the stream memory to {path}")
        return
    s = open_store(cfg)
    records = s.list(namespace)
    if memory_ids:
        wanted = set(s.resolve_ids(memory_ids, namespace))
        records = [r for r in records if r.id in wanted]
    if format_ == "peft":
        written = transfer.export_peft(s, records, out, cfg)
    else:
        single_file = len(records) == 1 and bool(memory_ids) and out.suffix == ".safetensors"
        written = transfer.export_files(s, records, out, single_file)
    typer.echo(json.dumps({"written": written}) if json_out else f"exported {len(written)} memories to {out}")


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

    Refused, with nothing written: a malformed or oversized file, an id that is not hex or that another
    namespace or model already uses, shapes that disagree with the model (a model prepared on this machine,
    else what the store already indexed for it). An adapter folder is checked against the config
    (memory.num_tokens, prefix position, the model's hidden size and embedding fingerprint); its keys are
    rebuilt with retrieval.key, which loads the model."""
    from elm_memory.store import transfer

    cfg = load_config(config, preset, set_, store, url)
    memories, adapters = transfer.read_imports(files, cfg)
    known = transfer.prepared_models()
    if adapters:
        info = transfer.rebuild_keys(adapters, cfg)
        known[info.fingerprint] = info
        memories += [m for _, m in adapters]
    point("import.read")
    s = open_store(cfg, create=True)
    s.known_models = known
    s.put_many(memories)
    ids = [m.id for m in memories]
    typer.echo(json.dumps({"imported": ids}) if json_out else f"imported {len(ids)} memories")


@memories_app.command("check")
@handle_errors
def check(
    store: StoreOpt = None,
    url: UrlOpt = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="Fix what is found (rebuild/drop rows, remove junk).")
    ] = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also re-hash every blob.")] = False,
    grace: Annotated[float, typer.Option(help="Keep temp files younger than this many seconds.")] = 600.0,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Find blobs without index rows, rows without blobs, stale and corrupt files; exit 1 if any remain unfixed.

    Also interrupted deletes and merges, and counters of deleted memories. --repair fixes what it can."""
    s = open_store(load_config(config, preset, set_, store, url))
    report = s.check(repair=repair, deep=deep, temp_grace_seconds=grace)
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
    else:
        for line in views.check_summary(report, repair):
            typer.echo(line)
    if not report.ok and (not repair or report.errors):
        raise typer.Exit(1)
