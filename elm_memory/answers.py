r"""Answer extraction and equivalence for math answers.

Model outputs are asked to "put your final answer within \boxed{}". This module turns a
completion into an answer string, decides whether two answers are the same, and runs the
majority vote whose agreement is the TTRL reward.

Extraction (:func:`extract_answer`)
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
      trailing period; an empty result is None.
    * Never raises on a ``str`` (any size; everything is linear-time, the regexes have no
      nested quantifiers); raises TypeError for anything else.

Equivalence (:func:`equivalent`)
    1. None (or a non-str) on either side: not equivalent. Two answers that normalise to
       nothing are not equivalent either.
    2. Fast path: equal after normalisation. The normalisation drops whitespace (except the
       one ending a control word before a letter, ``\pi r``), ``\left``/``\right``, spacing
       commands (``\! \, \; \: \quad``, ``~``), ``\displaystyle``, ``\$``, degree marks
       (``^\circ``, ``^{\circ}``, ``°``) and percent signs; maps ``\dfrac``/``\tfrac`` to
       ``\frac`` and ``\frac34`` to ``\frac{3}{4}``; unwraps ``\text{...}`` (and
       ``\textbf``, ``\mbox``, ``\mathrm``, ...) and drops a trailing unit
       (``5\text{ cm}`` -> ``5``); maps a parenthesised choice letter ``(B)`` to ``B``;
       removes thousands separators only from a whole number written like ``1,234,567``
       (``1{,}000`` too; ``1,2`` is left alone: it is a list); and writes decimals
       without trailing zeros (``18.0`` -> ``18``, ``.5`` -> ``0.5``).
    3. Otherwise math-verify, symmetrically: a ~ b iff ``verify(parse(a), parse(b))`` or
       ``verify(parse(b), parse(a))`` (math-verify's ``verify`` is not symmetric), with
       each normalised answer wrapped as ``\boxed{...}`` (then ``$...$``) so that
       ``parse`` extracts all of it. Parses and verdicts are cached.

    Decisions on the ambiguous cases:
      * ``10\%`` ~ ``10``: the percent sign is dropped, so ``10\%`` is NOT ~ ``0.1``
        (math-verify alone would say the opposite). A model asked for a percentage boxes
        ``10`` or ``10\%``, both meaning the same answer, and grouping them matters more
        for the vote than matching the rare ``0.1``.
      * ``x=5`` ~ ``5`` (math-verify's rule for a single-variable assignment), but
        ``x=5`` is not ~ ``y=5``.
      * ``\text{(B)}`` ~ ``(B)`` ~ ``B``. math-verify reads letters as symbols and
        lower-cases them, so ``B`` ~ ``b`` as well.
      * Identical strings are equivalent even when they are junk; math-verify reads
        letters as a product of symbols, so ``abc`` ~ ``cab``.

    Time limit: ``timeout`` seconds of wall-clock time for the math-verify step of one
    call (the fast path is not limited; ``timeout=None`` runs without limit; ``<= 0``
    uses the fast path only). A comparison that runs out of time counts as NOT
    equivalent. The limit is enforced the same way in every thread: math-verify is
    called with its own timeouts off (``parsing_timeout=None``, ``timeout_seconds=None``)
    in a daemon worker thread that the caller waits for with a deadline. math-verify's
    own timeouts use ``signal.alarm``, which raises ValueError outside the main thread,
    has one-second granularity, and replaces any SIGALRM handler the application (or
    pytest-timeout) has installed, so it is not used even in the main thread. A worker
    that ran out of time cannot be killed: it runs on in the background and stores its
    verdict in the cache when it ends. Calls into math-verify are serialised by a lock
    (its ANTLR parser is not known to be thread-safe; under the GIL this costs nothing).

    Neither a thread deadline nor an alarm can stop CPython big-integer arithmetic,
    which holds the GIL: ``9^{9^{9}}`` would freeze the whole process. So answers that
    could make sympy build a huge number (longer than 500 characters, a digit run longer
    than 100, power towers, exponents whose integers multiply past 10^5, factorials of
    anything but an integer up to 1000, sums/products/binomials with integers past 1000)
    are compared by the fast path only.

Majority vote (:func:`majority_vote`, :func:`majority_rewards`)
    Greedy clustering in order of appearance: an answer joins the first class whose
    representative (first member) is equivalent, else opens a new class; None answers
    belong to no class but count in ``total``. The largest class wins, ties go to the
    class that appeared first, and its representative is the voted answer. The TTRL
    reward of an answer is 1.0 if it is equivalent to the voted answer, else 0.0.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Vote",
    "equivalent",
    "extract_answer",
    "is_answer_closed",
    "majority_rewards",
    "majority_vote",
]

logger = logging.getLogger(__name__)

Fallback = Literal["none", "patterns", "last_number"]
_FALLBACKS = ("none", "patterns", "last_number")

# --------------------------------------------------------------------------- extraction

# One token regex drives a single left-to-right pass over the text. The alternatives are
# tried in order at each position: a box opener, an escaped brace or backslash (skipped, so
# "\{" is not a brace and "\\{" is a line break followed by a real brace), a bare brace.
_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[\\{}]|[{}]")
_BOX_CMDS = ("\\boxed", "\\fbox")


def _iter_closed_boxes(text: str, start: int = 0):
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


def _clean(answer: str) -> str:
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


_PATTERN_RE = re.compile(
    r"(?:\bfinal\s+answer\s+is\b\s*:?|\banswer\s*:|####)[ \t:*]*([^\n]*)", re.IGNORECASE
)
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
        cand = _clean(cand)
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
                content = _clean(text[start:end])
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
    return any(_clean(text[s:e]) for s, e in _iter_closed_boxes(text, first))


# ------------------------------------------------------------------------ normalisation

_TEXT_CMD_NAMES = ("text", "textbf", "textrm", "textit", "textnormal", "mbox", "mathrm", "mathbf")
_TEXT_CMDS = "(?:" + "|".join(_TEXT_CMD_NAMES) + ")"
_TEXT_WRAPPER_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]*)\}")
# A unit: words (and "/", ".") in a text command at the very end, maybe squared/cubed.
_UNIT_TAIL_RE = re.compile(
    r"\\" + _TEXT_CMDS + r"\s*\{\s*[A-Za-z][A-Za-z ./]*\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*"
)
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SPACING_RE = re.compile(r"\\[!,;: ]|\\q?quad(?![A-Za-z])|\\displaystyle(?![A-Za-z])|~")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°")
_FRAC_STYLE_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_BINOM_STYLE_RE = re.compile(r"\\[dt]binom(?![A-Za-z])")
_FRAC_SHORT_RE = re.compile(r"\\frac(\d)(\d)")
_FRAC_SHORT2_RE = re.compile(r"\\frac(\d)\{")
_FRAC_SHORT3_RE = re.compile(r"\\frac\{([^{}]*)\}(\d)")
_SQRT_SHORT_RE = re.compile(r"\\sqrt(\d)")
_CTRL_SPACE_RE = re.compile(r"(\\[A-Za-z]+) (?=[A-Za-z])")
_WS_RE = re.compile(r"\s+")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"-?\d*\.\d+|-?\d+\.")
_CHOICE_RE = re.compile(r"\(([A-Za-z])\)")


def _normalize(answer: str) -> str:
    """Canonical string form used by the fast path and passed to math-verify."""
    s = _clean(answer)
    s = s.replace("−", "-").replace("\\$", "").replace("{,}", ",")
    # Units: drop a trailing text unit after a value ("5\text{ cm}^2"), but only when the
    # value before it has no text of its own ("\text{A} or \text{B}" keeps its "B").
    at = max(s.rfind("\\" + name) for name in _TEXT_CMD_NAMES)
    if at > 0 and _UNIT_TAIL_RE.fullmatch(s, at):
        head = s[:at].rstrip()
        if head and not any("\\" + name in head for name in _TEXT_CMD_NAMES):
            s = head
    s = _TEXT_WRAPPER_RE.sub(r"\1", s)  # remaining wrappers: keep their content
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _FRAC_STYLE_RE.sub(r"\\frac", s)
    s = _BINOM_STYLE_RE.sub(r"\\binom", s)
    # Whitespace: keep only a space that ends a control word before a letter ("\pi r").
    s = _WS_RE.sub(" ", s).strip()
    s = _CTRL_SPACE_RE.sub("\\1\x00", s).replace(" ", "").replace("\x00", " ")
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT2_RE.sub(r"\\frac{\1}{", s)
    s = _FRAC_SHORT3_RE.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    s = _clean(s)
    m = _CHOICE_RE.fullmatch(s)
    if m:
        s = m.group(1)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _DECIMAL_RE.fullmatch(s):
        neg = s.startswith("-")
        digits = s.lstrip("-")
        whole, _, frac = digits.partition(".")
        frac = frac.rstrip("0")
        s = ("-" if neg else "") + (whole or "0") + ("." + frac if frac else "")
        if s == "-0":
            s = "0"
    return s


# ---------------------------------------------------------------- sympy safety guards

_MAX_SYMPY_LEN = 500
_MAX_DIGIT_RUN = 100
_MAX_EXPONENT = 10**5
_MAX_EXPONENT_DIGITS = 2 * 10**5  # (longest digit run) x (exponent bound)
_MAX_FACTORIAL = 1000
_MAX_BIG_OP_INT = 1000
_DIGIT_RUN_RE = re.compile(r"\d+")
_POWER_RE = re.compile(r"\^|\*\*")
_BIG_OP_RE = re.compile(r"\\(?:binom|choose|prod|sum)(?![A-Za-z])")


def _exponent_end(s: str, i: int) -> tuple[int, int, int]:
    """(content_start, content_end, end) of the exponent that starts at ``s[i]``."""
    n = len(s)
    while i < n and s[i] == " ":
        i += 1
    if i >= n:
        return i, i, i
    c = s[i]
    if c in "{(":
        close = "}" if c == "{" else ")"
        depth = 0
        for j in range(i, n):
            if s[j] == c:
                depth += 1
            elif s[j] == close:
                depth -= 1
                if depth == 0:
                    return i + 1, j, j + 1
        return i + 1, n, n  # unbalanced: the rest of the string
    j = i + 1
    if c == "\\":
        while j < n and s[j].isalpha():
            j += 1
    elif c.isdigit() or c == "-":
        while j < n and s[j].isdigit():
            j += 1
    return i, j, j


def _too_risky_for_sympy(s: str) -> bool:
    """True if sympy might build a huge integer from ``s`` (which no timeout can stop)."""
    if len(s) > _MAX_SYMPY_LEN:
        return True
    runs = [len(r) for r in _DIGIT_RUN_RE.findall(s)]
    longest = max(runs, default=0)
    if longest > _MAX_DIGIT_RUN:
        return True
    for m in _POWER_RE.finditer(s):
        start, end, after = _exponent_end(s, m.end())
        exponent = s[start:end]
        if "^" in exponent or "**" in exponent:
            return True  # a power tower
        rest = s[after:].lstrip()
        if rest.startswith(("^", "**")):
            return True  # "9^9^9": a tower without braces
        bound = 1
        for d in _DIGIT_RUN_RE.findall(exponent):
            bound = min(bound * max(int(d), 1), 10 * _MAX_EXPONENT)
        if bound > _MAX_EXPONENT or bound * max(longest, 1) > _MAX_EXPONENT_DIGITS:
            return True
    for i, ch in enumerate(s):
        if ch == "!" and not s.startswith("=", i + 1):
            j = i
            while j > 0 and s[j - 1] == " ":
                j -= 1
            k = j
            while k > 0 and s[k - 1].isdigit():
                k -= 1
            if k == j or int(s[k:j]) > _MAX_FACTORIAL:
                return True
    if _BIG_OP_RE.search(s):
        if any(int(d) > _MAX_BIG_OP_INT for d in _DIGIT_RUN_RE.findall(s)):
            return True
    return False


# ------------------------------------------------------------------------- math-verify

_MV_LOCK = threading.Lock()  # serialises calls into math-verify (ANTLR parser state)
_MV_IMPORT_LOCK = threading.Lock()
_mv_module: Any = None
_mv_failed = False

_VERDICT_CACHE_MAX = 65536
_verdicts: dict[tuple[str, str], bool] = {}
_verdicts_lock = threading.Lock()


def _load_math_verify() -> Any:
    """Import math-verify once (outside any deadline: importing sympy takes a while)."""
    global _mv_module, _mv_failed
    if _mv_module is not None or _mv_failed:
        return _mv_module
    with _MV_IMPORT_LOCK:
        if _mv_module is None and not _mv_failed:
            try:
                import math_verify
                import math_verify.grader
                import math_verify.parser

                # We enforce the time limit ourselves, so math-verify's one-time warning
                # "Timeout is disabled ... you must provide the logic" does not apply.
                math_verify.grader.TIMEOUT_WARNING_SHOWN = True
                math_verify.parser.TIMEOUT_WARNING_SHOWN = True
                _mv_module = math_verify
            except Exception:  # not installed or broken: fall back to the fast path
                logger.warning(
                    "math-verify unavailable; answers compared as strings only", exc_info=True
                )
                _mv_failed = True
    return _mv_module


@functools.lru_cache(maxsize=8192)
def _parse(answer: str) -> tuple:
    """math-verify's parse of a normalised answer (a tuple, so the cached value is immutable)."""
    mv = _mv_module
    for wrapped in ("\\boxed{" + answer + "}", "$" + answer + "$"):
        try:
            parsed = mv.parse(wrapped, parsing_timeout=None, raise_on_error=False)
        except Exception:
            parsed = []
        if parsed:
            return tuple(parsed)
    return ()


def _math_verify_equal(a: str, b: str) -> bool:
    """Symmetric math-verify verdict on two normalised answers; cached; never raises."""
    mv = _mv_module
    try:
        pa, pb = list(_parse(a)), list(_parse(b))
        result = bool(pa and pb) and bool(
            mv.verify(pa, pb, timeout_seconds=None, raise_on_error=False)
            or mv.verify(pb, pa, timeout_seconds=None, raise_on_error=False)
        )
    except Exception:
        logger.debug("math-verify failed on %r vs %r", a[:80], b[:80], exc_info=True)
        result = False
    with _verdicts_lock:
        if len(_verdicts) >= _VERDICT_CACHE_MAX:
            _verdicts.clear()  # crude bound; the cache refills with the current questions
        _verdicts[(a, b)] = result
    return result


def _locked_math_verify_equal(a: str, b: str, wait: float | None) -> bool | None:
    if not _MV_LOCK.acquire(timeout=-1 if wait is None else max(wait, 0.0)):
        return None  # gave up waiting: the caller has already timed out
    try:
        return _math_verify_equal(a, b)
    finally:
        _MV_LOCK.release()


def _run_with_deadline(a: str, b: str, timeout: float) -> bool | None:
    """The verdict from a daemon worker thread, or None if it is not ready in ``timeout`` s.

    Daemon, not a ThreadPoolExecutor: executor threads are joined at interpreter exit, so
    a worker stuck in sympy would hang the process on shutdown.
    """
    box: list[bool | None] = [None]

    def work() -> None:
        try:
            box[0] = _locked_math_verify_equal(a, b, timeout)
        except BaseException:  # noqa: BLE001 - nothing may escape a worker thread
            box[0] = False

    worker = threading.Thread(target=work, name="elm-answers-verify", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        logger.debug("math-verify timed out after %.2fs on %r vs %r", timeout, a[:80], b[:80])
        return None
    return box[0]


def equivalent(a: str | None, b: str | None, *, timeout: float | None = 2.0) -> bool:
    """Whether two answers are the same (see the module doc for the rules).

    Never raises. A comparison that takes longer than ``timeout`` seconds counts as not
    equivalent. Safe to call from any thread.
    """
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    try:
        na, nb = _normalize(a), _normalize(b)
    except Exception:  # defensive: normalisation is plain string work
        return False
    if not na or not nb:
        return False
    if na == nb:
        return True
    if timeout is not None and timeout <= 0:
        return False
    if _too_risky_for_sympy(na) or _too_risky_for_sympy(nb):
        return False
    key = (na, nb) if na <= nb else (nb, na)  # verdicts are symmetric
    cached = _verdicts.get(key)
    if cached is not None:
        return cached
    if _load_math_verify() is None:
        return False
    if timeout is None:
        return bool(_locked_math_verify_equal(*key, None))
    return bool(_run_with_deadline(*key, timeout))


# ---------------------------------------------------------------------- majority vote


@dataclass(frozen=True)
class Vote:
    """Outcome of a majority vote: the winning answer and how many of ``total`` agree."""

    answer: str | None
    count: int
    total: int  # all answers given, None included

    @property
    def share(self) -> float:
        return self.count / self.total if self.total else 0.0


def majority_vote(answers: Sequence[str | None], *, timeout: float | None = 2.0) -> Vote:
    """Greedy equivalence clustering; the largest class wins, ties by first appearance."""
    answers = list(answers)
    reps: list[str] = []  # first member of each class, in order of appearance
    counts: list[int] = []
    seen: dict[str, int] = {}  # identical strings land in the same class: compare once
    for ans in answers:
        if not isinstance(ans, str):
            continue
        idx = seen.get(ans)
        if idx is None:
            idx = next(
                (i for i, rep in enumerate(reps) if equivalent(ans, rep, timeout=timeout)), -1
            )
            if idx < 0:
                reps.append(ans)
                counts.append(0)
                idx = len(reps) - 1
            seen[ans] = idx
        counts[idx] += 1
    if not reps:
        return Vote(None, 0, len(answers))
    best = max(range(len(reps)), key=lambda i: (counts[i], -i))  # ties: earliest class
    return Vote(reps[best], counts[best], len(answers))


def majority_rewards(
    answers: Sequence[str | None], vote: Vote | None = None, *, timeout: float | None = 2.0
) -> list[float]:
    """TTRL rewards: 1.0 for each answer equivalent to the majority answer, else 0.0."""
    answers = list(answers)
    if vote is None:
        vote = majority_vote(answers, timeout=timeout)
    if vote.answer is None:
        return [0.0] * len(answers)
    return [1.0 if equivalent(a, vote.answer, timeout=timeout) else 0.0 for a in answers]
