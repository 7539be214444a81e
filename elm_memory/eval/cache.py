"""A greedy-generation cache shared by the methods of one evaluation run.

Greedy decoding is a function of the prompt, so when ``zero_shot`` and ``elm_input`` run on
the same question, ELM's zero-shot candidate is the very generation ``zero_shot`` already
made. Serving it from the cache makes comparing k methods cost one zero-shot pass per
question instead of k, and guarantees ELM's "its zero-shot" column is the zero_shot row.
Sampled calls (rollouts, verifier@k) always go to the backend.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from elm_memory.backends.base import Generation, PromptLike, SamplingParams, to_prompt_input


class GreedyCache:
    """Wraps a :class:`~elm_memory.backends.base.GenerationBackend`; everything but
    ``generate`` is the wrapped backend's own attribute."""

    def __init__(self, backend: Any, size: int = 512):
        self._backend = backend
        self._size = size
        self._entries: OrderedDict[tuple, Generation] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @staticmethod
    def _key(prompt: Any, params: SamplingParams) -> tuple:
        soft = None
        if prompt.soft_prompt is not None:
            t = prompt.soft_prompt.detach().float().cpu().contiguous()
            soft = hashlib.sha256(t.numpy().tobytes()).hexdigest() + str(tuple(t.shape))
        adapter = None if prompt.memory is None else f"{prompt.memory.kind}:{prompt.memory.digest()}"
        return (
            prompt.token_ids,
            soft,
            adapter,
            prompt.soft_prompt_at,
            params.max_new_tokens,
            params.stop_at_answer,
            params.logprobs,
        )

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        if not params.greedy or params.n != 1:
            return self._backend.generate(prompts, params)
        inputs = [to_prompt_input(p, self._backend.tokenizer) for p in prompts]
        keys = [self._key(p, params) for p in inputs]
        missing = [i for i, k in enumerate(keys) if k not in self._entries]
        self.hits += len(inputs) - len(missing)
        self.misses += len(missing)
        if missing:
            fresh = self._backend.generate([inputs[i] for i in missing], params)
            for i, [gen] in zip(missing, fresh, strict=True):
                self._entries[keys[i]] = gen
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
        out = []
        for k in keys:
            self._entries.move_to_end(k)
            out.append([copy.deepcopy(self._entries[k])])
        return out
