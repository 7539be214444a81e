"""Transformers backend: batched greedy/sampled generation with soft prompts via ``inputs_embeds``.

Prompts without a soft prompt take the plain ``input_ids`` path; as soon as one prompt
in a batch carries a soft prompt, the whole batch is fed as embeddings (left-padded).
The model is the one frozen instance the rest of the library shares.

Seeds: a call's ``SamplingParams.seed`` seeds torch's global generator (the samples of a
prompt then depend on the whole batch). A prompt with its own ``PromptInput.seed`` is
sampled from its own generator instead (prompts of that call without one get
``seed + i * n``, as the vLLM backend): its samples are the same alone or in any batch,
up to float rounding of the batched forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elm_memory.answers import is_answer_closed
from elm_memory.backends.base import (
    Generation,
    PromptInput,
    PromptLike,
    SamplingParams,
    compose_embeddings,
    to_prompt_input,
)
from elm_memory.models.loading import LoadedModel


class _StopAtAnswer:
    """Per-sequence stopping once a ``\\boxed{}`` is closed (cheap: only re-decodes after a ``}``)."""

    def __init__(self, tokenizer: Any, prompt_len: int):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.closed: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.closed is None:
            self.closed = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        new = input_ids[:, self.prompt_len :]
        if new.shape[1] == 0:
            return self.closed.clone()
        last = self.tokenizer.batch_decode(new[:, -1:])
        for i, piece in enumerate(last):
            if not self.closed[i] and "}" in piece:
                self.closed[i] = is_answer_closed(self.tokenizer.decode(new[i], skip_special_tokens=True))
        return self.closed.clone()


class _SeededSampler:
    """Temperature / top-p sampling from one CPU generator per prompt, as a logits processor.

    Rows are prompt-major (prompt ``i``'s ``n`` samples are rows ``i*n .. i*n+n-1``). Each step
    draws ``n`` uniforms from each prompt's generator and inverts the row's CDF; the returned
    scores keep only the drawn token, which generate's greedy pick then takes. A prompt's
    draws therefore never depend on the other prompts in the batch (a finished batch-mate
    keeps drawing, but only after its own samples are complete).
    """

    def __init__(self, seeds: list[int], n: int, temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.n = n
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = torch.cat([torch.rand(self.n, generator=g, dtype=torch.float64) for g in self.generators])
        probs = torch.softmax(scores.float() / self.temperature, dim=-1).double()
        if self.top_p < 1.0:
            # keep the most likely tokens until their mass reaches top_p (at least one)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        cdf = probs.cumsum(-1)
        target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
        # right=True: the first token whose CDF exceeds the draw, so zero-probability tokens are never picked
        token = torch.searchsorted(cdf, target, right=True).clamp(max=scores.shape[-1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, token, 0.0)


class HFBackend:
    """:class:`~elm_memory.backends.base.GenerationBackend` on a transformers model."""

    name = "hf"

    def __init__(self, loaded: LoadedModel, *, batch_size: int = 16):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.batch_size = batch_size
        self.device = torch.device(loaded.info.device)
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_ids: list[int] = eos_ids
        self.pad_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos_ids[0]

    @classmethod
    def from_config(cls, cfg: Any, loaded: LoadedModel | None = None) -> HFBackend:
        from elm_memory.models.loading import load_model

        return cls(loaded or load_model(cfg.model))

    # -- public --------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.no_grad()
    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        inputs = [to_prompt_input(p, self.tokenizer) for p in prompts]
        out: list[list[Generation]] = []
        per_call = max(1, self.batch_size // max(1, params.n))
        for start in range(0, len(inputs), per_call):
            out.extend(self._generate_batch(inputs[start : start + per_call], params, offset=start))
        return out

    @torch.no_grad()
    def token_logprobs(self, prompt: PromptInput, completions: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities (temperature 1) of each completion token given the prompt, teacher-forced."""
        results: list[list[float]] = []
        for comp in completions:
            if not comp:
                results.append([])
                continue
            emb = compose_embeddings(prompt, self.embed_tokens)
            comp_ids = torch.tensor(list(comp), dtype=torch.long, device=self.device)
            full = torch.cat([emb, self.embed_tokens(comp_ids)], dim=0).unsqueeze(0)
            logits = self.model(inputs_embeds=full).logits[0, emb.shape[0] - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, comp_ids.unsqueeze(1)).squeeze(1)
            results.append(lp.tolist())
        return results

    # -- internals -----------------------------------------------------------------
    def _generate_batch(
        self, batch: list[PromptInput], params: SamplingParams, offset: int = 0
    ) -> list[list[Generation]]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        # Per-prompt generators: we sample ourselves (a logits processor) and let generate pick
        # the one token left, greedily; generate cannot return n sequences greedily, so the
        # prompts are repeated n times here instead.
        per_prompt = not params.greedy and any(p.seed is not None for p in batch)
        reps = params.n if per_prompt else 1

        use_embeds = any(p.soft_prompt is not None for p in batch)
        lengths = [p.length for p in batch]
        width = max(lengths)
        mask = torch.zeros(len(batch), width, dtype=torch.long, device=self.device)
        for i, n in enumerate(lengths):
            mask[i, width - n :] = 1  # left padding: new tokens follow every prompt directly
        # An explicit config so a model's generation_config.json (top_k, repetition penalty...)
        # never changes what "greedy" or "temperature 0.8" means here.
        sample = not params.greedy and not per_prompt
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=None,
            num_return_sequences=params.n // reps,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            return_dict_in_generate=False,
        )
        kwargs: dict[str, Any] = {"attention_mask": mask, "generation_config": gen_cfg}
        if use_embeds:
            hidden = self.model.get_input_embeddings().weight.shape[1]
            embeds = torch.zeros(len(batch), width, hidden, dtype=self.model.dtype, device=self.device)
            for i, p in enumerate(batch):
                embeds[i, width - lengths[i] :] = compose_embeddings(p, self.embed_tokens)
            kwargs["inputs_embeds"] = embeds
            prompt_len = 0  # with inputs_embeds, generate returns only the new tokens
        else:
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long, device=self.device)
            for i, p in enumerate(batch):
                ids[i, width - lengths[i] :] = torch.tensor(p.token_ids, dtype=torch.long)
            kwargs["input_ids"] = ids
            prompt_len = width
        if reps > 1:
            for key in ("attention_mask", "inputs_embeds", "input_ids"):
                if key in kwargs:
                    kwargs[key] = kwargs[key].repeat_interleave(reps, dim=0)
        if per_prompt:
            seeds = [self._prompt_seed(p, params, offset + i) for i, p in enumerate(batch)]
            kwargs["logits_processor"] = LogitsProcessorList(
                [_SeededSampler(seeds, params.n, params.temperature, params.top_p)]
            )
        stopper = None
        if params.stop_at_answer:
            stopper = _StopAtAnswer(self.tokenizer, prompt_len)
            kwargs["stopping_criteria"] = StoppingCriteriaList([stopper])
        if params.seed is not None and not per_prompt:
            torch.manual_seed(params.seed)
        sequences = self.model.generate(**kwargs)
        new = sequences[:, prompt_len:].tolist()
        answered = stopper.closed.tolist() if stopper is not None and stopper.closed is not None else None

        out: list[list[Generation]] = []
        for i, prompt in enumerate(batch):
            gens = []
            for j in range(params.n):
                row = i * params.n + j
                gens.append(self._finish(new[row], answered[row] if answered else False))
            if params.logprobs:
                lps = self.token_logprobs(prompt, [g.token_ids for g in gens])
                for g, lp in zip(gens, lps, strict=True):
                    g.logprobs = lp
            out.append(gens)
        return out

    @staticmethod
    def _prompt_seed(prompt: PromptInput, params: SamplingParams, index: int) -> int:
        if prompt.seed is not None:
            return prompt.seed
        if params.seed is not None:
            return params.seed + index * params.n
        return int(torch.randint(0, 2**62, ()).item())  # unseeded: from the global generator

    def _finish(self, tokens: list[int], answered: bool) -> Generation:
        kept: list[int] = []
        reason: str = "length"
        for t in tokens:
            if t in self.eos_ids:
                reason = "stop"
                break
            kept.append(t)
        if answered:
            # Stopped by the answer criterion: what follows is padding, not completion.
            reason = "answer"
            while kept and kept[-1] == self.pad_id:
                kept.pop()
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Generation(text=text, token_ids=kept, finish_reason=reason)
