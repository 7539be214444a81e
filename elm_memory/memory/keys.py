"""Retrieval keys: the vectors a memory is filed under and a new question is looked up by.

Four builders: the first three from the paper (Sec. "Memory Key Construction / Memory Retrieval"),
``kv_centered`` a variant of its ``kv``:

``input``
    query = mean over the question's tokens of the input embeddings, ``mean_t E(x)``;
    memory key = the same function of the *memory's own question* tokens. Retrieval is
    then question-to-question similarity in the embedding space ("constructed
    analogously at memory creation").
``soft_prompt_mean``
    query as for ``input``; memory key = mean of the k learned soft-prompt vectors (the
    paper's "pooling directly over the learnable token embeddings"). The soft prompt is
    initialised from the question's embeddings, so both sides live in the same space,
    and the key follows what training did to the prompt.
``kv``
    per decoder layer l, the query side pools the attention *query* projections of the
    question, the memory side pools the attention *key* projections of the soft prompt
    passed through the model (alone: as a prefix under causal attention its activations
    do not depend on what follows). Pooling is a mean over positions and heads, so with
    grouped-query attention both sides are ``head_dim`` vectors. Projections are read
    before RoPE (rotating by position and then averaging over positions would mix the
    phases). The score is ``mean_l cos(q_l, k_l)``; we store the concatenation of the
    per-layer L2-normalised vectors, whose cosine is exactly that mean (each side has
    norm sqrt(L)), so an ordinary cosine index ranks by the paper's score.

``kv_centered``
    ``kv`` with each side's common direction removed: per layer, the mean of the side's unit vectors
    over a fixed calibration set (:data:`CENTERING_QUESTIONS` questions of the packaged MATH500) is
    subtracted and the difference renormalised before the cosine. On the default model the raw KV
    cosines all lie within 0.01-0.06 and one memory can take most retrievals
    (``benchmarks/key_quality.py``); centring spreads them. Not in the paper; an option.

``lora`` and ``prefix`` memories have no soft prompt: their memory side is built from the memory's
question instead (paper, LoRA ablation: "keys are obtained by passing the input question through
the model and extracting activations", computed once at memory creation). ``input`` is the same
as for a soft prompt; ``kv`` pools the key projections of the question's own tokens run through the
model (:func:`memory_inputs` hands the builders the question's embeddings in place of a soft
prompt); ``soft_prompt_mean`` has nothing to pool and refuses them.

Questions are keyed *without* the prompt template or chat markup: those tokens are the
same for every question and would pull all keys towards one direction.

Every builder needs one forward pass at most (hooks on the frozen model, no copy of
it), runs under ``torch.no_grad`` and always removes its hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from elm_memory.errors import ConfigError, MemoryFormatError
from elm_memory.memory.ids import validate_question
from elm_memory.memory.key_registry import key_builders as key_builders  # its names need no torch

if TYPE_CHECKING:
    from elm_memory.memory.latent import LatentMemory
    from elm_memory.models.loading import LoadedModel, ModelInfo

QuestionIds = Sequence[int] | torch.Tensor


@runtime_checkable
class KeyBuilder(Protocol):
    """Turns a question (query side) or a memory (memory side) into a 1-D float32 key.

    ``memory_key`` receives both the soft prompt and the memory's question ids because
    builders differ in which one they use; ``memory_keys`` is the batched form (one
    forward for many soft prompts where the builder runs the model).
    """

    kind: str

    def dim(self, info: ModelInfo) -> int: ...

    def query_key(self, loaded: LoadedModel, question_ids: QuestionIds) -> torch.Tensor: ...

    def memory_key(self, loaded: LoadedModel, soft_prompt: torch.Tensor, question_ids: QuestionIds) -> torch.Tensor: ...

    def memory_keys(
        self, loaded: LoadedModel, soft_prompts: Sequence[torch.Tensor], question_ids: Sequence[QuestionIds]
    ) -> torch.Tensor: ...


# ---- helpers --------------------------------------------------------------------------


def _ids_tensor(question_ids: QuestionIds, device: Any) -> torch.Tensor:
    ids = torch.as_tensor(question_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ConfigError("cannot build a retrieval key from an empty question (no tokens)")
    return ids.to(device)


def _embedding(loaded: LoadedModel) -> torch.nn.Module:
    return loaded.model.get_input_embeddings()


def mean_input_embedding(loaded: LoadedModel, question_ids: QuestionIds) -> torch.Tensor:
    """``mean_t E(x)`` in float32 (a table lookup; the model is not run)."""
    emb = _embedding(loaded)
    with torch.no_grad():
        ids = _ids_tensor(question_ids, emb.weight.device)
        return emb(ids).to(torch.float32).mean(dim=0).cpu()


def _check_soft_prompt(loaded: LoadedModel, soft_prompt: torch.Tensor) -> None:
    if soft_prompt.dim() != 2 or soft_prompt.shape[1] != loaded.info.hidden_size:
        raise MemoryFormatError(
            f"soft prompt of shape {tuple(soft_prompt.shape)} does not fit hidden size {loaded.info.hidden_size}"
        )


def memory_inputs(
    loaded: LoadedModel, memories: Sequence[LatentMemory], question_ids: Sequence[QuestionIds], builder_kind: str
) -> list[torch.Tensor]:
    """What a builder's ``memory_keys`` receives for each memory as its "soft prompt": the soft prompt of a
    soft-prompt memory, the question's input embeddings for a lora/prefix memory (see the module doc)."""
    out = []
    for m, ids in zip(memories, question_ids, strict=True):
        if m.kind == "soft_prompt":
            out.append(m.soft_prompt)
            continue
        if builder_kind == "soft_prompt_mean":
            raise ConfigError(
                f"retrieval.key=soft_prompt_mean pools a soft prompt; memory {m.id[:8]} is a {m.kind} memory "
                "(use retrieval.key=input or kv)"
            )
        emb = _embedding(loaded)
        with torch.no_grad():
            out.append(emb(_ids_tensor(ids, emb.weight.device)).to("cpu", torch.float32))
    return out


class _MeanEmbeddingQuery:
    """Shared query side of the ``input`` and ``soft_prompt_mean`` keys."""

    kind = ""

    def dim(self, info: ModelInfo) -> int:
        return info.hidden_size

    def query_key(self, loaded: LoadedModel, question_ids: QuestionIds) -> torch.Tensor:
        return mean_input_embedding(loaded, question_ids)

    def memory_keys(
        self, loaded: LoadedModel, soft_prompts: Sequence[torch.Tensor], question_ids: Sequence[QuestionIds]
    ) -> torch.Tensor:
        # Lookups and means only: a loop costs nothing next to a forward pass.
        return torch.stack([self.memory_key(loaded, sp, q) for sp, q in zip(soft_prompts, question_ids, strict=True)])

    def memory_key(self, loaded: LoadedModel, soft_prompt: torch.Tensor, question_ids: QuestionIds) -> torch.Tensor:
        raise NotImplementedError


class InputKeyBuilder(_MeanEmbeddingQuery):
    """``input``: memory key = mean input embedding of the memory's question tokens."""

    kind = "input"

    def memory_key(self, loaded: LoadedModel, soft_prompt: torch.Tensor, question_ids: QuestionIds) -> torch.Tensor:
        return mean_input_embedding(loaded, question_ids)


class SoftPromptMeanKeyBuilder(_MeanEmbeddingQuery):
    """``soft_prompt_mean``: memory key = mean of the learned soft-prompt vectors."""

    kind = "soft_prompt_mean"

    def memory_key(self, loaded: LoadedModel, soft_prompt: torch.Tensor, question_ids: QuestionIds) -> torch.Tensor:
        _check_soft_prompt(loaded, soft_prompt)
        return soft_prompt.detach().to("cpu", torch.float32).mean(dim=0)


# ---- KV keys --------------------------------------------------------------------------


def attention_modules(model: Any) -> list[Any]:
    """The decoder layers' ``self_attn`` modules, in layer order (must expose q_proj and k_proj)."""
    found = [
        module.self_attn
        for _, module in model.named_modules()
        if hasattr(getattr(module, "self_attn", None), "q_proj") and hasattr(module.self_attn, "k_proj")
    ]
    return found


def _decoder(model: Any) -> Any:
    """The transformer body without the LM head: the vocabulary projection is not needed for keys."""
    get = getattr(model, "get_decoder", None)
    body = get() if callable(get) else None
    return body if body is not None else model


class KVKeyBuilder:
    """``kv``: per-layer pooled attention queries (question) vs keys (memory), see the module doc."""

    kind = "kv"

    def dim(self, info: ModelInfo) -> int:
        return info.num_layers * info.head_dim

    def query_key(self, loaded: LoadedModel, question_ids: QuestionIds) -> torch.Tensor:
        ids = _ids_tensor(question_ids, _embedding(loaded).weight.device).unsqueeze(0)
        return self._run(loaded, "q_proj", loaded.info.num_attention_heads, input_ids=ids)[0]

    def memory_key(self, loaded: LoadedModel, soft_prompt: torch.Tensor, question_ids: QuestionIds) -> torch.Tensor:
        return self.memory_keys(loaded, [soft_prompt], [question_ids])[0]

    def memory_keys(
        self,
        loaded: LoadedModel,
        soft_prompts: Sequence[torch.Tensor],
        question_ids: Sequence[QuestionIds] | None = None,
    ) -> torch.Tensor:
        """One forward for all soft prompts of equal length (grouped by length otherwise)."""
        prompts = list(soft_prompts)
        if not prompts:
            return torch.empty(0, self.dim(loaded.info))
        for sp in prompts:
            _check_soft_prompt(loaded, sp)
        out = torch.empty(len(prompts), self.dim(loaded.info))
        by_len: dict[int, list[int]] = {}
        for i, sp in enumerate(prompts):
            by_len.setdefault(int(sp.shape[0]), []).append(i)
        weight: torch.Tensor = _embedding(loaded).weight  # type: ignore[assignment]  # nn.Module attrs are untyped
        for idx in by_len.values():
            batch = torch.stack([prompts[i].detach() for i in idx]).to(weight.device, weight.dtype)
            out[idx] = self._run(loaded, "k_proj", loaded.info.num_key_value_heads, inputs_embeds=batch)
        return out

    def _run(self, loaded: LoadedModel, proj: str, n_heads: int, **inputs: torch.Tensor) -> torch.Tensor:
        """Forward once with a hook on every layer's ``proj``; return (batch, L*head_dim) keys."""
        info = loaded.info
        layers = attention_modules(loaded.model)
        if len(layers) != info.num_layers:
            raise ConfigError(
                f"retrieval.key=kv needs separate q_proj/k_proj in each of the {info.num_layers} attention layers of "
                f"{info.name} (found {len(layers)}); use retrieval.key=input"
            )
        pooled: list[torch.Tensor | None] = [None] * len(layers)

        def make_hook(layer: int) -> Any:
            def hook(_module: Any, _args: Any, output: torch.Tensor) -> None:
                b, t, _ = output.shape
                heads = output.detach().to(torch.float32).view(b, t, n_heads, info.head_dim)
                pooled[layer] = heads.mean(dim=(1, 2))  # over positions and heads -> (b, head_dim)

            return hook

        handles = []
        try:
            for i, attn in enumerate(layers):
                handles.append(getattr(attn, proj).register_forward_hook(make_hook(i)))
            with torch.no_grad():
                _decoder(loaded.model)(**inputs, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        if any(p is None for p in pooled):
            raise ConfigError(f"the {proj} hooks of {info.name} did not all fire; use retrieval.key=input")
        per_layer = torch.stack([p for p in pooled if p is not None], dim=1)  # (b, L, head_dim)
        return F.normalize(per_layer, dim=-1).flatten(1).cpu()


# ---- centred KV keys ------------------------------------------------------------------------

#: Key kinds stored as L concatenated unit vectors, one per layer (a merge renormalises per layer).
LAYERWISE_KINDS = ("kv", "kv_centered")
#: The calibration set of ``kv_centered``: the packaged MATH500's first questions in seed-0 order
#: (what ``benchmarks/key_quality.py`` measured with), each memory side standing in as the soft prompt
#: a memory of it starts from (``memory.init: question``, the paper's k).
CENTERING_DATASET = "math500"
CENTERING_QUESTIONS = 64
CENTERING_PROMPT_TOKENS = 20

# per frozen model: (query-side mean, memory-side mean), each (layers, head_dim); computed once per process
_centres: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()
_centres_lock = threading.Lock()


def _recentre(keys: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """(n, L*head_dim) per-layer unit keys -> the same with ``centre`` (L, head_dim) removed, per layer renormalised."""
    per_layer = keys.view(keys.shape[0], *centre.shape) - centre
    return F.normalize(per_layer, dim=-1).flatten(1)


class KVCenteredKeyBuilder(KVKeyBuilder):
    """``kv_centered``: ``kv`` keys with each side's calibration mean removed per layer (module doc)."""

    kind = "kv_centered"

    def query_key(self, loaded: LoadedModel, question_ids: QuestionIds) -> torch.Tensor:
        raw = super().query_key(loaded, question_ids)
        return _recentre(raw.unsqueeze(0), self.centres(loaded)[0])[0]

    def memory_keys(
        self,
        loaded: LoadedModel,
        soft_prompts: Sequence[torch.Tensor],
        question_ids: Sequence[QuestionIds] | None = None,
    ) -> torch.Tensor:
        raw = super().memory_keys(loaded, soft_prompts, question_ids)
        return raw if raw.shape[0] == 0 else _recentre(raw, self.centres(loaded)[1])

    def centres(self, loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's (query, memory) per-layer means over the calibration set. Every process that
        loads the same model in the same dtype on the same kind of device computes the same means, so
        keys built by a learner and queries built by the answerer agree (across devices, up to their
        rounding). About 2 x 64 short forward passes, once per process and model."""
        with _centres_lock:
            found = _centres.get(loaded.model)
            if found is None:
                found = self._calibrate(loaded)
                _centres[loaded.model] = found
            return found

    def _calibrate(self, loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
        # imported here: only calibration needs the packaged data
        from elm_memory.data.datasets import load_problems
        from elm_memory.memory.init import question_init

        questions = [p.question for p in load_problems(CENTERING_DATASET, limit=CENTERING_QUESTIONS, seed=0)]
        plain = KVKeyBuilder()
        queries = torch.stack([plain.query_key(loaded, tokenize_question(loaded.tokenizer, q)) for q in questions])
        prompts = [question_init(loaded, q, CENTERING_PROMPT_TOKENS, "question", 0) for q in questions]
        memories = plain.memory_keys(loaded, prompts)
        shape = (len(questions), loaded.info.num_layers, loaded.info.head_dim)
        return queries.view(shape).mean(dim=0), memories.view(shape).mean(dim=0)


def tokenize_question(tokenizer: Any, question: Any) -> list[int]:
    """Key tokens of a question: its own text, no template or special tokens (module docstring)."""
    text = validate_question(question)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
