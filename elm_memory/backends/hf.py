"""Transformers backend: batched greedy/sampled generation with soft prompts via ``inputs_embeds``.

Prompts without a soft prompt take the plain ``input_ids`` path; as soon as one prompt
in a batch carries a soft prompt, the whole batch is fed as embeddings (left-padded).
The model is the one frozen instance the rest of the library shares.

Decoding runs in the library's loop (:mod:`elm_memory.backends.decode`; ``backend.decode_loop:
elm``), which prefills each prompt once for its n samples and drops finished rows, or in
transformers' ``generate`` (``decode_loop: generate``, the reference). With ``backend.one_row_engine``
resolved to ``int4``, a call of at most two rows runs that loop on an int4 weight-only copy of the linear
layers instead (:mod:`elm_memory.backends.int4`; :meth:`HFBackend.decode_engine` says which per call).

A ``lora`` or ``prefix`` memory (``PromptInput.memory``) is applied around the model calls of the
prompts that carry it (forward hooks, or a KV cache starting with its prefix): prompts are grouped
by memory and each group is decoded as its own batch, so the zero-shot and memory candidates of
one question are two decode batches for those kinds (one for a soft prompt).

Seeds: each prompt has its own generator, seeded by ``PromptInput.seed`` or else by
``SamplingParams.seed + i * n`` (as the vLLM backend); it draws one key per row, and each token's
draw is a hash of the key and the token's index (:mod:`elm_memory.backends.sampling`), so a
prompt's samples are the same alone or in any batch, up to float rounding of the batched forward.
Without any seed the global generator draws the keys.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import torch

from elm_memory.backends import decode, int4
from elm_memory.backends.base import (
    Generation,
    PromptInput,
    PromptLike,
    SamplingParams,
    compose_embeddings,
    sampling_seed,
    to_prompt_input,
)
from elm_memory.backends.captured import CapturedSteps, unsupported_reason
from elm_memory.backends.decode import DecodeOptions
from elm_memory.backends.lookup import RecentOutputs
from elm_memory.backends.one_row import OneRowEngines
from elm_memory.backends.postprocess import answer_closed_after, eos_ids_of, finish_generation
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.errors import ConfigError
from elm_memory.memory.kinds import LORA, MemoryAdapter
from elm_memory.memory.lora import LoraAdapter, RowLoras
from elm_memory.models.loading import LoadedModel

log = logging.getLogger(__name__)


class _StopAtAnswer:
    """Per-sequence stopping once a ``\\boxed{}`` is closed (cheap: only re-decodes after a ``}``)."""

    def __init__(self, tokenizer: Any, prompt_len: int):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.closed: torch.Tensor | None = None
        self.has_brace: dict[int, bool] = {}  # token id -> its text contains "}"

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.closed is None:
            self.closed = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        new = input_ids[:, self.prompt_len :]
        if new.shape[1] == 0:
            return self.closed.clone()
        for i, row in enumerate(new.tolist()):
            if not self.closed[i]:
                self.closed[i] = answer_closed_after(self.tokenizer, row, row[-1], self.has_brace)
        return self.closed.clone()


class HFBackend:
    """:class:`~elm_memory.backends.base.GenerationBackend` on a transformers model."""

    name = "hf"
    # generate_many decodes several calls as one batch (what elm_memory.backends.fusing relies on)
    batches_calls = True

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        batch_size: int = 64,
        decode_loop: str = "elm",
        share_prompt_kv: bool = True,
        drop_finished: bool = True,
        lookup_draft_tokens: int = 0,
        lookup_max_rows: int = 8,
        decode_graphs: str = "auto",
        one_row_engine: str = "plain",
        int4_group: int = int4.GROUP_SIZE,
        int4_lm_head: bool = False,
    ):
        if decode_graphs not in ("auto", "on", "off", "static"):
            raise ValueError(f"decode_graphs must be auto, on, off or static, not {decode_graphs!r}")
        if decode_loop == "generate" and lookup_draft_tokens > 0:
            raise ValueError("lookup_draft_tokens needs decode_loop='elm'; transformers' generate has no lookup drafts")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.batch_size = batch_size  # most sequences (prompts x samples) decoded together
        self.decode_loop = decode_loop
        self.share_prompt_kv = share_prompt_kv
        self.drop_finished = drop_finished
        self.lookup_draft_tokens = lookup_draft_tokens
        self.lookup_max_rows = lookup_max_rows
        self.recent = RecentOutputs()  # what lookup drafts may copy from besides the batch itself
        self._closes_brace: dict[int, bool] = {}  # token id -> its text contains "}" (stop-at-answer check)
        self.device = torch.device(loaded.info.device)
        self.eos_ids: list[int] = eos_ids_of(self.model.generation_config.eos_token_id, self.tokenizer)
        self.pad_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.decode_graphs = decode_graphs
        self._captured: CapturedSteps | None = None
        self._captured_mode = self._resolve_graphs(decode_graphs)
        self.engine_calls: Counter[str] = Counter()  # decode calls per engine ("plain", "int4", "llama")
        self.one_row = OneRowEngines(
            one_row_engine,
            self.model,
            self.info,
            decode_loop=decode_loop,
            int4_group=int4_group,
            int4_lm_head=int4_lm_head,
            calls=self.engine_calls,
        )

    @classmethod
    def from_config(cls, cfg: Any, loaded: LoadedModel | None = None) -> HFBackend:
        from elm_memory.models.loading import load_model

        b = cfg.backend
        return cls(
            loaded or load_model(cfg.model),
            batch_size=b.max_batch_rows,
            decode_loop=b.decode_loop,
            share_prompt_kv=b.share_prompt_kv,
            drop_finished=b.drop_finished,
            lookup_draft_tokens=b.lookup_draft_tokens,
            lookup_max_rows=b.lookup_max_rows,
            decode_graphs=b.decode_graphs,
            one_row_engine=b.one_row_engine,
            int4_lm_head=b.int4_lm_head,
        )

    # -- public --------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.no_grad()
    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        inputs = [to_prompt_input(p, self.tokenizer) for p in prompts]
        out: list[list[Generation] | None] = [None] * len(inputs)
        per_call = max(1, self.batch_size // max(1, params.n))
        # prompts with a LoRA or none share batches (each LoRA on its own rows); a prefix memory's cache serves a
        # whole batch, and the generate loop applies one memory to all: one batch per memory there
        groups: dict[Any, list[int]] = {}
        for i, p in enumerate(inputs):
            rows = self.decode_loop == "elm" and (p.memory is None or p.memory.kind == LORA)
            groups.setdefault("rows" if rows else id(p.memory), []).append(i)
        for indices in groups.values():
            for start in range(0, len(indices), per_call):
                chunk = indices[start : start + per_call]
                gens = self._generate_batch([inputs[i] for i in chunk], params, chunk)
                for i, g in zip(chunk, gens, strict=True):
                    out[i] = g
        return [g for g in out if g is not None]

    @torch.no_grad()
    def generate_many(
        self, requests: Sequence[tuple[Sequence[PromptLike], SamplingParams]]
    ) -> list[list[list[Generation]]]:
        """Several ``generate`` calls at once: what each returns, with the prompts of calls that can share a
        batch decoded as one (each prompt under its own call's params and seed, so its rows are the ones its
        own call would decode, up to the batch's effect on bf16 arithmetic).

        Prompts with a LoRA memory or none share a batch: each LoRA's delta reaches its own rows only
        (:class:`~elm_memory.memory.lora.RowLoras`), so a stream memory's greedy answer and samples decode
        beside the base model's rows. Calls with a prefix memory or ``logprobs``, the ``generate`` decode loop,
        and calls that together pass ``backend.max_batch_rows`` rows run one by one.
        """
        calls = [([to_prompt_input(p, self.tokenizer) for p in prompts], params) for prompts, params in requests]
        out: list[list[list[Generation]] | None] = [None] * len(calls)
        shareable = [
            i
            for i, (inputs, params) in enumerate(calls)
            if self.decode_loop == "elm"
            and not params.logprobs
            and all(p.memory is None or p.memory.kind == LORA for p in inputs)
        ]
        if len(shareable) > 1 and sum(len(calls[i][0]) * calls[i][1].n for i in shareable) <= self.batch_size:
            for i, result in zip(shareable, self._generate_fused([calls[i] for i in shareable]), strict=True):
                out[i] = result
        for i, (inputs, params) in enumerate(calls):
            if out[i] is None:
                out[i] = self.generate(inputs, params)
        return [r for r in out if r is not None]

    def _generate_fused(
        self, calls: Sequence[tuple[list[PromptInput], SamplingParams]]
    ) -> list[list[list[Generation]]]:
        """Calls whose prompts have LoRA memories or none, decoded as one batch."""
        batch = [p for inputs, _ in calls for p in inputs]
        options, generators, stops = [], [], []
        for inputs, params in calls:
            for index, prompt in enumerate(inputs):  # the index its own call gives it: the same seed
                options.append(self._decode_options(params))
                seed = None if params.greedy else self._prompt_seed(prompt, params, index)
                generators.append(None if seed is None else torch.Generator(device=self.device).manual_seed(seed))
                stops.extend([params.stop_at_answer] * params.n)
        tensors, mask = self._left_padded(batch)

        def stop(row: int, tokens: list[int], token: int) -> bool:
            return stops[row] and self._answer_closed(row, tokens, token)

        decoded = self._sample(
            batch,
            [params.n for inputs, params in calls for _ in inputs],
            mask,
            options,
            eos_ids=self.eos_ids,
            generators=generators if any(g is not None for g in generators) else None,
            should_stop=stop if any(stops) else None,
            memory=_one_memory(batch),
            **tensors,
        )
        out: list[list[list[Generation]]] = []
        row = 0
        for inputs, params in calls:
            gens: list[list[Generation]] = []
            for _ in inputs:
                gens.append([self._finish(*decoded[row + j]) for j in range(params.n)])
                row += params.n
            out.append(gens)
        return out

    @torch.no_grad()
    def token_logprobs(self, prompt: PromptInput, completions: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities (temperature 1) of each completion token given the prompt, teacher-forced."""
        # one completion per forward: a batch of G long completions would hold G x (T, vocab) logits
        return [completion_logprobs(self.model, [prompt], [c])[0][0].tolist() if c else [] for c in completions]

    # -- internals -----------------------------------------------------------------
    def _generate_batch(
        self, batch: list[PromptInput], params: SamplingParams, indices: Sequence[int]
    ) -> list[list[Generation]]:
        """One decode batch; ``indices``: each prompt's place in the call (its default seed)."""
        inputs, mask = self._left_padded(batch)
        seeds = (
            [self._prompt_seed(p, params, i) for i, p in zip(indices, batch, strict=True)]
            if not params.greedy
            else None
        )
        if self.decode_loop == "elm":
            rows = self._decode_loop(batch, inputs, mask, params, seeds)
        elif (memory := batch[0].memory) is not None:  # generate() groups this loop's prompts by memory
            if memory.kind != "lora":
                raise ConfigError(
                    f"backend.decode_loop=generate cannot apply a {memory.kind} memory; use decode_loop=elm"
                )
            with memory.apply(self.model, len(batch)):
                rows = self._decode_generate(inputs, mask, params, seeds)
        else:
            rows = self._decode_generate(inputs, mask, params, seeds)

        out: list[list[Generation]] = []
        for i, prompt in enumerate(batch):
            gens = [self._finish(*rows[i * params.n + j]) for j in range(params.n)]
            if params.logprobs:
                lps = self.token_logprobs(prompt, [g.token_ids for g in gens])
                for g, lp in zip(gens, lps, strict=True):
                    g.logprobs = lp
            out.append(gens)
        return out

    def _left_padded(self, batch: list[PromptInput]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``input_ids`` (or ``inputs_embeds`` once any prompt has a soft prompt) and the mask, left-padded
        so that new tokens follow every prompt directly."""
        lengths = [p.length for p in batch]
        width = max(lengths)
        mask = torch.zeros(len(batch), width, dtype=torch.long, device=self.device)
        for i, n in enumerate(lengths):
            mask[i, width - n :] = 1
        if any(p.soft_prompt is not None for p in batch):
            hidden = self.model.get_input_embeddings().weight.shape[1]
            embeds = torch.zeros(len(batch), width, hidden, dtype=self.model.dtype, device=self.device)
            for i, p in enumerate(batch):
                embeds[i, width - lengths[i] :] = compose_embeddings(p, self.embed_tokens)
            return {"inputs_embeds": embeds}, mask
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(batch):
            ids[i, width - lengths[i] :] = torch.tensor(p.token_ids, dtype=torch.long)
        return {"input_ids": ids}, mask

    def _decode_loop(
        self,
        batch: list[PromptInput],
        inputs: dict[str, torch.Tensor],
        mask: torch.Tensor,
        params: SamplingParams,
        seeds: list[int] | None,
    ) -> list[tuple[list[int], str]]:
        options = self._decode_options(params)
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds] if seeds else None
        stop = self._answer_closed if params.stop_at_answer else None
        return self._sample(
            batch,
            [params.n] * len(batch),
            mask,
            options,
            eos_ids=self.eos_ids,
            generators=generators,
            should_stop=stop,
            memory=_one_memory(batch),
            **inputs,
        )

    def _sample(
        self, batch: list[PromptInput], rows: list[int], mask: torch.Tensor, options: Any, **kwargs: Any
    ) -> list[tuple[list[int], str]]:
        """:func:`decode.sample` on ``batch`` (``rows[i]`` rows for prompt i); with lookup drafts, seeded
        with what was generated before for the same prompt texts, and remembering what it generates."""
        engine = self.decode_engine(sum(rows), kwargs.get("memory"))
        if engine == "llama":
            done = self.one_row.llama_sample(batch, rows, options, kwargs, self.embed_tokens)
            if done is not None:
                self.engine_calls[engine] += 1
                return done
            engine = "plain"  # llama.cpp failed: logged once, and the plain loop serves from now on
        self.engine_calls[engine] += 1
        model = self.model
        if engine == "int4":
            model = self.one_row.int4_model(kwargs)
        if not self.lookup_draft_tokens:
            captured = self._captured_steps() if engine == "plain" else None
            return decode.sample(model, mask, options, captured=captured, **kwargs)
        prompts = [p.token_ids for p in batch]
        decoded = decode.sample(
            model, mask, options, prompt_tokens=prompts, earlier_outputs=self.recent.get(prompts), **kwargs
        )
        row = 0
        for prompt, n in zip(prompts, rows, strict=True):
            self.recent.add(prompt, [tokens for tokens, _ in decoded[row : row + n]])
            row += n
        return decoded

    def decode_engine(self, rows: int, memory: MemoryAdapter | None = None) -> str:
        """What decodes a call of ``rows`` rows under ``memory`` (:meth:`OneRowEngines.pick`)."""
        return self.one_row.pick(rows, memory)

    @property
    def one_row_engine(self) -> str:
        """``backend.one_row_engine`` resolved for this model and device: ``plain``, ``int4`` or ``llama``."""
        return self.one_row.engine

    @property
    def one_row_reason(self) -> str:
        return self.one_row.reason

    def _resolve_graphs(self, setting: str) -> str:
        """``compile``, ``static`` or ``off``: what ``backend.decode_graphs`` means for this model and device."""
        mode = {"on": "compile", "static": "static", "off": "off"}.get(setting)
        if mode is None:  # auto: CUDA graphs pay on a GPU; on a CPU compiling costs more than it saves (docs/results)
            mode = "compile" if self.device.type == "cuda" else "off"
        if mode == "off" or self.decode_loop != "elm":
            return "off"
        if self.lookup_draft_tokens:
            log.info("backend.decode_graphs: lookup drafts decode several tokens a step; using the plain loop")
            return "off"
        reason = unsupported_reason(self.model)
        if reason is not None:
            log.info("backend.decode_graphs: %s; using the plain loop", reason)
            return "off"
        return mode

    def _captured_steps(self) -> CapturedSteps | None:
        """The captured decode steps, made on first use (compiling happens per bucket, on its first call)."""
        if self._captured_mode == "off":
            return None
        if self._captured is None:
            self._captured = CapturedSteps(
                self.model,
                compile=self._captured_mode == "compile",
                max_rows=self.batch_size,
                max_cache_len=self.info.max_context,
            )
        return self._captured

    def _decode_options(self, params: SamplingParams) -> DecodeOptions:
        return DecodeOptions(
            max_new_tokens=params.max_new_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=params.top_p,
            n=params.n,
            share_prompt_kv=self.share_prompt_kv,
            drop_finished=self.drop_finished,
            lookup_draft_tokens=self.lookup_draft_tokens,
            lookup_max_rows=self.lookup_max_rows,
        )

    def _answer_closed(self, row: int, tokens: list[int], token: int) -> bool:
        return answer_closed_after(self.tokenizer, tokens, token, self._closes_brace)

    def _decode_generate(
        self, inputs: dict[str, torch.Tensor], mask: torch.Tensor, params: SamplingParams, seeds: list[int] | None
    ) -> list[tuple[list[int], str]]:
        """The reference path: transformers' ``generate``. Per-prompt seeds mean one call per prompt."""
        if seeds is not None and len(seeds) > 1:
            rows: list[tuple[list[int], str]] = []
            for i, seed in enumerate(seeds):
                one = {k: v[i : i + 1] for k, v in inputs.items()}
                width = int(mask[i].sum())
                one = {k: v[:, -width:] for k, v in one.items()}
                rows.extend(self._decode_generate(one, mask[i : i + 1, -width:], params, [seed]))
            return rows
        from transformers import GenerationConfig, StoppingCriteriaList

        # An explicit config so a model's generation_config.json (top_k, repetition penalty...)
        # never changes what "greedy" or "temperature 0.8" means here.
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=None,
            num_return_sequences=params.n,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            return_dict_in_generate=False,
        )
        # with inputs_embeds, generate returns only the new tokens
        prompt_len = inputs["input_ids"].shape[1] if "input_ids" in inputs else 0
        kwargs: dict[str, Any] = {"attention_mask": mask, "generation_config": gen_cfg, **inputs}
        stopper = None
        if params.stop_at_answer:
            stopper = _StopAtAnswer(self.tokenizer, prompt_len)
            kwargs["stopping_criteria"] = StoppingCriteriaList([stopper])
        if seeds:
            torch.manual_seed(seeds[0])
        sequences = self.model.generate(**kwargs)[:, prompt_len:].tolist()
        answered = stopper.closed.tolist() if stopper is not None and stopper.closed is not None else None
        rows = []
        for r, tokens in enumerate(sequences):
            if answered and answered[r]:
                # stopped by the answer criterion: what follows is padding, not completion
                while tokens and tokens[-1] == self.pad_id:
                    tokens.pop()
                rows.append((tokens, "answer"))
            else:
                rows.append((tokens, "length"))
        return rows

    @staticmethod
    def _prompt_seed(prompt: PromptInput, params: SamplingParams, index: int) -> int:
        seed = sampling_seed(prompt, params, index)
        # unseeded: drawn from the global generator, so torch.manual_seed still makes runs repeat
        return seed if seed is not None else int(torch.randint(0, 2**62, ()).item())

    def _finish(self, tokens: list[int], reason: str) -> Generation:
        """Cut at the first EOS (kept out of the completion); ``reason`` is the decoder's unless an EOS came first."""
        return finish_generation(self.tokenizer, tokens, self.eos_ids, engine_reason=reason)


def _one_memory(batch: Sequence[PromptInput]) -> MemoryAdapter | None:
    """What a fused batch applies: the memory every prompt shares (or none), else each prompt's LoRA on its rows."""
    memories = [p.memory for p in batch]
    if len({id(m) for m in memories}) == 1:
        return memories[0]
    return RowLoras([cast(LoraAdapter | None, m) for m in memories])
