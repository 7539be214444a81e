"""A greedy-generation cache shared by the methods of one evaluation run.

Greedy decoding is a function of the prompt, so when ``zero_shot`` and ``elm_input`` run on
the same question, ELM's zero-shot candidate is the very generation ``zero_shot`` already
made. Serving it from the cache makes comparing k methods cost one zero-shot pass per
question instead of k, and guarantees ELM's "its zero-shot" column is the zero_shot row.
Sampled calls (rollouts, verifier@k) always go to the backend, and answers conditioned on a
memory are not kept (no other method asks for them). A resumed run puts back the zero-shot
answers it recorded (:meth:`GreedyCache.put`), so the guarantee holds across restarts.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from elm_memory.backends.base import (
    GenerateRequest,
    Generation,
    PromptLike,
    SamplingParams,
    generate_requests,
    to_prompt_input,
)


class _Key(NamedTuple):
    """What makes two greedy calls the same generation."""

    token_ids: tuple[int, ...]
    soft_prompt: str | None  # digest of the soft prompt's values and shape
    adapter: str | None  # kind and digest of a lora/prefix memory
    soft_prompt_at: int
    max_new_tokens: int
    stop_at_answer: bool
    logprobs: bool


class GreedyCache:
    """Wraps a :class:`~elm_memory.backends.base.GenerationBackend`; everything but
    ``generate`` is the wrapped backend's own attribute."""

    def __init__(self, backend: Any, size: int = 512):
        self._backend = backend
        self._size = size
        self._entries: OrderedDict[_Key, Generation] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @staticmethod
    def _key(prompt: Any, params: SamplingParams) -> _Key:
        soft = None
        if prompt.soft_prompt is not None:
            t = prompt.soft_prompt.detach().float().cpu().contiguous()
            soft = hashlib.sha256(t.numpy().tobytes()).hexdigest() + str(tuple(t.shape))
        adapter = None if prompt.memory is None else f"{prompt.memory.kind}:{prompt.memory.digest()}"
        return _Key(
            tuple(prompt.token_ids),
            soft,
            adapter,
            prompt.soft_prompt_at,
            params.max_new_tokens,
            params.stop_at_answer,
            bool(params.logprobs),
        )

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        return self.generate_many([(prompts, params)])[0]

    def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[list[Generation]]]:
        """Each call's cache hits served here, everything else in one ``generate_many`` of the
        backend (one ``generate`` when only one call is left, or the backend has no ``generate_many``)."""
        plans: list[tuple[list[_Key], list[int]] | None] = []  # per call: (keys, missing) or None (sampled)
        forward: list[GenerateRequest] = []
        for prompts, params in requests:
            if not params.greedy or params.n != 1:
                plans.append(None)
                forward.append((prompts, params))
                continue
            inputs = [to_prompt_input(p, self._backend.tokenizer) for p in prompts]
            keys = [self._key(p, params) for p in inputs]
            missing = [i for i, k in enumerate(keys) if k not in self._entries]
            self.hits += len(inputs) - len(missing)
            self.misses += len(missing)
            plans.append((keys, missing))
            if missing:
                forward.append(([inputs[i] for i in missing], params))
        fresh = iter(generate_requests(self._backend, forward))
        out: list[list[list[Generation]]] = []
        for plan in plans:
            if plan is None:
                out.append(next(fresh))
                continue
            keys, missing = plan
            made = dict(zip(missing, next(fresh), strict=True)) if missing else {}
            gens = []
            for i, k in enumerate(keys):
                if i in made:
                    gens.append(made[i])
                    self._keep(k, made[i][0])
                else:
                    self._entries.move_to_end(k)
                    gens.append([copy.deepcopy(self._entries[k])])
            out.append(gens)
        return out

    def put(self, prompt: PromptLike, params: SamplingParams, generation: Generation) -> None:
        """Remember ``generation`` as the greedy answer to ``prompt`` (a resumed run restores the
        zero-shot answers it recorded, so ELM's zero-shot candidate is still that very answer)."""
        if not params.greedy or params.n != 1:
            raise ValueError("only greedy, single-completion generations are cached")
        self._keep(self._key(to_prompt_input(prompt, self._backend.tokenizer), params), generation)

    def _keep(self, key: _Key, generation: Generation) -> None:
        # Only prompts without a memory: they are the ones another method asks for again (a soft
        # prompt or adapter is one question's memory), and keeping the others would push zero-shot
        # answers still to be shared out of a long run's cache.
        if key.soft_prompt is not None or key.adapter is not None:
            return
        self._entries[key] = copy.deepcopy(generation)
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
