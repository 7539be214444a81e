"""Draft tokens for speculative decoding by lookup: no draft model, the text already there.

A math answer restates the question's numbers and names and repeats its own phrases ("the total
number of cookies ..."), and answers to one question repeat each other. So the tokens that followed
the last time a row's final n tokens appeared are a good guess of what comes next. They are looked
up in the row's prompt, its own output, the other rows of the same prompt text in the batch (a
question's rollouts and its memory-conditioned answer: their soft prompts differ, their text does
not) and outputs generated earlier for that text (the backend remembers its recent ones, e.g. the
zero-shot answer before the memory's rollouts). The decode loop feeds those guesses with the row's
next token and keeps the ones the model agrees with (:mod:`elm_memory.backends.decode`). On a CPU
a forward of a few tokens per row costs little more than one (``benchmarks/verify_cost.py``), so
every accepted guess saves most of a step.

Rows never draft from another question's text: what a prompt samples depends on its own text and
its history, not on which other questions share the batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

#: n-gram lengths tried, longest first: a longer match predicts better, a shorter one matches more often.
NGRAM_SIZES = (3, 2, 1)


class LookupDrafter:
    """The rows' texts (prompt + generated tokens), indexed by n-gram per group of rows whose prompts
    have the same tokens.

    ``index[group][ngram]`` is the latest (row, position) after which ``ngram`` was followed by at
    least one token: an n-gram is indexed only once the token after it exists, so a row's own
    final n-gram never points at itself.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        row_prompt: Sequence[int],
        max_draft: int,
        earlier: Sequence[Sequence[Sequence[int]]] = (),
    ):
        """``earlier[i]``: outputs generated before for prompt i's tokens (read-only texts to draft from)."""
        if max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        self.max_draft = max_draft
        groups: dict[tuple[int, ...], int] = {}
        prompt_group = [groups.setdefault(tuple(p), len(groups)) for p in prompts]
        self.row_group = [prompt_group[p] for p in row_prompt]
        self.texts = [list(prompts[p]) for p in row_prompt]
        self.index: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in groups]
        seen: set[int] = set()
        for row, g in enumerate(self.row_group):
            if g not in seen:  # the prompt's own n-grams, once per group (any of its rows holds them)
                seen.add(g)
                for end in range(1, len(self.texts[row])):
                    self._add(row, end)
        for p, outputs in enumerate(earlier):  # after the prompts: the latest match wins, and these say more
            for output in outputs:
                if output and p < len(prompts):
                    self.texts.append([*prompts[p], *output])
                    self.row_group.append(prompt_group[p])
                    for end in range(len(prompts[p]), len(self.texts[-1])):
                        self._add(len(self.texts) - 1, end)

    def _add(self, row: int, end: int) -> None:
        """Index the n-grams of ``row`` ending just before ``end`` (the token at ``end`` follows them)."""
        text, group = self.texts[row], self.index[self.row_group[row]]
        for n in NGRAM_SIZES:
            if end >= n:
                group[tuple(text[end - n : end])] = (row, end)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Tokens appended to ``row``'s output."""
        text = self.texts[row]
        for tok in tokens:
            text.append(tok)
            self._add(row, len(text) - 1)

    def draft(self, row: int, limit: int | None = None) -> list[int]:
        """Up to ``max_draft`` (and ``limit``) tokens guessed to follow ``row``'s text; may be empty."""
        k = self.max_draft if limit is None else min(self.max_draft, limit)
        if k < 1:
            return []
        text, group = self.texts[row], self.index[self.row_group[row]]
        for n in NGRAM_SIZES:
            if len(text) < n:
                continue
            hit = group.get(tuple(text[-n:]))
            if hit is not None:
                src, start = hit
                return self.texts[src][start : start + k]
        return []


class RecentOutputs:
    """What a backend generated lately, per prompt text: the earlier texts lookup drafts from.

    Bounded (the latest ``per_prompt`` outputs of the latest ``prompts`` prompt texts) and
    thread-safe: answering and learning threads share one backend."""

    def __init__(self, prompts: int = 256, per_prompt: int = 8):
        self.prompts, self.per_prompt = prompts, per_prompt
        self._outputs: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, prompts: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        with self._lock:
            return [list(self._outputs.get(tuple(p), ())) for p in prompts]

    def add(self, prompt: Sequence[int], outputs: Sequence[Sequence[int]]) -> None:
        key = tuple(prompt)
        with self._lock:
            kept = self._outputs.pop(key, [])
            kept = [*kept, *(list(o) for o in outputs if o)][-self.per_prompt :]
            self._outputs[key] = kept
            while len(self._outputs) > self.prompts:
                self._outputs.popitem(last=False)
