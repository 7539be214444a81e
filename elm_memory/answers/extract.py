r"""Extraction: the final answer of a completion, the content of its last closed ``\boxed{}``.

Rules of :func:`extract_answer`:

* The answer is the content of the LAST closed ``\boxed{...}`` (``\boxed {...}`` and
  ``\fbox{...}`` too), with nested braces balanced: ``\boxed{\frac{1}{2}}`` gives
  ``\frac{1}{2}``. "Last" means the box that opens last among those that close, so an
  unclosed final ``\boxed{`` (a rollout cut off mid-answer) is ignored and the previous
  closed box is used, and ``\boxed{\boxed{5}}`` gives ``5``. Escaped braces ``\{``
  ``\}`` do not count as braces.
* A box that is empty (after stripping) is not an answer: models write ``\boxed{}``
  when they repeat the instruction.
* Fallbacks when there is no (non-empty) box, chosen with ``fallback=``:
  ``"none"``: return None. ``"patterns"`` (default): the last "final answer is X",
  "answer: X" or "#### X" on a line (X runs to the end of that line, or to the closing
  ``$`` / ``\)`` when it opens with one); a captured X that contains a ``\boxed`` (an
  unclosed one) is skipped, since it is an answer that was cut off. ``"last_number"``:
  the patterns, then the last number in the text. Last-number is opt-in only: it
  would give unfinished rollouts (which always contain some number) an answer, and so
  a share of the vote and a reward.
* The result is stripped of surrounding whitespace, ``$``, ``\(`` ``\)``, ``**`` and a
  trailing period (:func:`clean_answer`); an empty result is None.
* Never raises on a ``str`` (any size; everything is linear-time, the regexes have no
  nested quantifiers); raises TypeError for anything else.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

Fallback = Literal["none", "patterns", "last_number"]
_FALLBACKS = ("none", "patterns", "last_number")

# One token regex drives a single left-to-right pass over the text. The alternatives are
# tried in order at each position: a box opener, an escaped brace or backslash (skipped, so
# "\{" is not a brace and "\\{" is a line break followed by a real brace), a bare brace.
_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[\\{}]|[{}]")
_BOX_CMDS = ("\\boxed", "\\fbox")


def _iter_closed_boxes(text: str, start: int = 0) -> Iterator[tuple[int, int]]:
    """Yield (content_start, content_end) of every closed box, in order of closing. O(n)."""
    # Stack of open braces: the content start for a box opener, -1 for a plain brace.
    stack: list[int] = []
    for m in _TOKEN_RE.finditer(text, start):
        tok = m.group()
        if len(tok) == 2 and tok[0] == "\\":  # escaped: not structure
            continue
        if tok[-1] == "{":
            stack.append(m.end() if len(tok) > 1 else -1)
        elif stack:  # a stray "}" with nothing open is ignored
            opened = stack.pop()
            if opened >= 0:
                yield opened, m.start()


def _first_box_index(text: str) -> int:
    found = [i for i in (text.find(cmd) for cmd in _BOX_CMDS) if i >= 0]
    return min(found) if found else -1


def clean_answer(answer: str) -> str:
    """Strip whitespace, ``$``, ``\\(`` ``\\)``, ``\\[`` ``\\]``, ``**`` and a trailing period."""
    s = answer
    # A few rounds peel "$5$." layer by layer; a fixed count keeps adversarial input
    # like "$.$.$.$." linear instead of quadratic.
    for _ in range(4):
        prev = s
        s = s.strip().strip("$*").strip()
        if s.startswith(("\\(", "\\[")):
            s = s[2:]
        if s.endswith(("\\)", "\\]")):
            s = s[:-2]
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1]
        if s == prev:
            break
    return s


_PATTERN_RE = re.compile(r"(?:\bfinal\s+answer\s+is\b\s*:?|\banswer\s*:|####)[ \t:*]*([^\n]*)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+)?")


def _pattern_answer(text: str) -> str | None:
    best: str | None = None
    for m in _PATTERN_RE.finditer(text):
        cand = m.group(1).strip()
        # "$x$ because ..." or "\(x\) ...": keep the math span only.
        for opener, closer in (("$", "$"), ("\\(", "\\)")):
            if cand.startswith(opener):
                end = cand.find(closer, len(opener))
                if end > 0:
                    cand = cand[len(opener) : end]
                break
        if "\\boxed" in cand or "\\fbox" in cand:
            continue  # an unclosed box: the rollout was cut off mid-answer
        cand = clean_answer(cand)
        if cand:
            best = cand
    return best


def _last_number(text: str) -> str | None:
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m.group()
    return last


def extract_answer(text: str, fallback: Fallback = "patterns") -> str | None:
    r"""The final answer in ``text``: the last closed ``\boxed{}`` (see the module doc).

    ``fallback`` ("none" | "patterns" | "last_number") says what to try when there is no
    non-empty box. Returns None when nothing is found. Raises TypeError if ``text`` is
    not a str and ValueError for an unknown ``fallback``.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects str, got {type(text).__name__}")
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")

    first = _first_box_index(text)
    if first >= 0:
        best_start, best = -1, None
        for start, end in _iter_closed_boxes(text, first):
            if start > best_start:
                content = clean_answer(text[start:end])
                if content:  # an empty box is a placeholder, not an answer
                    best_start, best = start, content
        if best is not None:
            return best

    if fallback == "none":
        return None
    found = _pattern_answer(text)
    if found is None and fallback == "last_number":
        found = _last_number(text)
    return found


def is_answer_closed(text: str) -> bool:
    r"""True once ``text`` holds a closed, non-empty ``\boxed{...}`` (or ``\fbox{...}``).

    Meant for stopping a rollout early, so it is called on growing text: it returns False
    at once without a box command, scans only from the first one, and stops at the first
    box that closes. ``\boxed{}`` does not count (it is the instruction being repeated).
    """
    if not isinstance(text, str):
        raise TypeError(f"is_answer_closed expects str, got {type(text).__name__}")
    first = _first_box_index(text)
    if first < 0:
        return False
    return any(clean_answer(text[s:e]) for s, e in _iter_closed_boxes(text, first))
