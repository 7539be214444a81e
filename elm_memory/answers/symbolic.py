r"""Symbolic comparison of two normalised answers through math-verify (sympy), made safe to call
from any request thread.

Symmetric: a ~ b iff ``verify(parse(a), parse(b))`` or ``verify(parse(b), parse(a))``
(math-verify's ``verify`` is not symmetric), with each answer wrapped as ``\boxed{...}``
(then ``$...$``) so that ``parse`` extracts all of it.

Time limit: ``timeout`` seconds of wall-clock time per comparison (``None``: no limit). A
comparison that runs out of time counts as NOT equivalent. The limit is enforced the same
way in every thread: math-verify is called with its own timeouts off
(``parsing_timeout=None``, ``timeout_seconds=None``) in a daemon worker thread that the
caller waits for with a deadline. math-verify's own timeouts use ``signal.alarm``, which
raises ValueError outside the main thread, has one-second granularity, and replaces any
SIGALRM handler the application (or pytest-timeout) has installed, so it is not used even
in the main thread. A worker that ran out of time cannot be killed: it runs on in the
background and stores its verdict in the cache when it ends.

Neither a thread deadline nor an alarm can stop CPython big-integer arithmetic, which holds
the GIL: ``9^{9^{9}}`` would freeze the whole process. So answers that could make sympy
build a huge number (:func:`too_risky_for_sympy`: longer than 500 characters, a digit run
longer than 100, power towers, exponents whose integers multiply past 10^5, factorials of
anything but an integer up to 1000, sums/products/binomials with integers past 1000) are
never given to it.

Process-wide state, kept to three objects and each locked: the math-verify module (imported
once), one lock that serialises calls into it (its ANTLR parser is not known to be
thread-safe; under the GIL this costs nothing), and the bounded verdict cache (a verdict is
a pure function of two strings, so every request may reuse another's).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- sympy safety guard

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


def _huge_power(s: str, longest_digits: int) -> bool:
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
        if bound > _MAX_EXPONENT or bound * max(longest_digits, 1) > _MAX_EXPONENT_DIGITS:
            return True
    return False


def _huge_factorial(s: str) -> bool:
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
    return False


def too_risky_for_sympy(s: str) -> bool:
    """True if sympy might build a huge integer from ``s`` (which no timeout can stop)."""
    if len(s) > _MAX_SYMPY_LEN:
        return True
    longest = max((len(r) for r in _DIGIT_RUN_RE.findall(s)), default=0)
    if longest > _MAX_DIGIT_RUN or _huge_power(s, longest) or _huge_factorial(s):
        return True
    return bool(_BIG_OP_RE.search(s)) and any(int(d) > _MAX_BIG_OP_INT for d in _DIGIT_RUN_RE.findall(s))


# ------------------------------------------------------------------------- math-verify


class _LazyMathVerify:
    """math-verify, imported once on first use (outside any deadline: importing sympy takes a while).

    None when it is not installed or broken: answers are then compared as strings only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False

    def get(self) -> Any:
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                try:
                    import math_verify
                    import math_verify.grader
                    import math_verify.parser

                    # We enforce the time limit ourselves, so math-verify's one-time warning
                    # "Timeout is disabled ... you must provide the logic" does not apply.
                    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
                    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
                    self._module = math_verify
                except ImportError as exc:  # not installed: say so in one line
                    logger.warning("math-verify unavailable (%s); answers compared as strings only", exc)
                    self._failed = True
                except Exception:  # installed but broken: the traceback says how
                    logger.warning("math-verify unavailable; answers compared as strings only", exc_info=True)
                    self._failed = True
        return self._module


class VerdictCache:
    """Bounded, thread-safe map from a sorted answer pair to math-verify's verdict."""

    def __init__(self, max_size: int = 65536):
        self.max_size = max_size
        self._items: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> bool | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: tuple[str, str], verdict: bool) -> None:
        with self._lock:
            if len(self._items) >= self.max_size:
                self._items.clear()  # crude bound; the cache refills with the current questions
            self._items[key] = verdict


_MATH_VERIFY = _LazyMathVerify()
_CALL_LOCK = threading.Lock()  # one call into math-verify at a time (ANTLR parser state)
_VERDICTS = VerdictCache()


@functools.lru_cache(maxsize=8192)  # lru_cache is thread-safe; calls come under _CALL_LOCK anyway
def _parse(answer: str) -> tuple[Any, ...]:
    """math-verify's parse of a normalised answer (a tuple, so the cached value is immutable)."""
    mv = _MATH_VERIFY.get()
    for wrapped in ("\\boxed{" + answer + "}", "$" + answer + "$"):
        try:
            parsed = mv.parse(wrapped, parsing_timeout=None, raise_on_error=False)
        except Exception:
            parsed = []
        if parsed:
            return tuple(parsed)
    return ()


def math_verify_equal(a: str, b: str) -> bool:
    """Symmetric math-verify verdict on two normalised answers, without a time limit; cached;
    never raises. Callers hold ``_CALL_LOCK``."""
    mv = _MATH_VERIFY.get()
    try:
        pa, pb = list(_parse(a)), list(_parse(b))
        result = bool(pa and pb) and bool(
            mv.verify(pa, pb, timeout_seconds=None, raise_on_error=False)
            or mv.verify(pb, pa, timeout_seconds=None, raise_on_error=False)
        )
    except Exception:
        logger.debug("math-verify failed on %r vs %r", a[:80], b[:80], exc_info=True)
        result = False
    _VERDICTS.put((a, b), result)
    return result


def _locked_math_verify_equal(a: str, b: str, wait: float | None) -> bool | None:
    if not _CALL_LOCK.acquire(timeout=-1 if wait is None else max(wait, 0.0)):
        return None  # gave up waiting: the caller has already timed out
    try:
        return math_verify_equal(a, b)
    finally:
        _CALL_LOCK.release()


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


def symbolic_equal(a: str, b: str, timeout: float | None) -> bool:
    """Whether math-verify finds two normalised answers equal within ``timeout`` seconds
    (None: no limit). Risky answers, a missing math-verify and a timeout all count as not equal."""
    if too_risky_for_sympy(a) or too_risky_for_sympy(b):
        return False
    key = (a, b) if a <= b else (b, a)  # verdicts are symmetric
    cached = _VERDICTS.get(key)
    if cached is not None:
        return cached
    if _MATH_VERIFY.get() is None:
        return False
    if timeout is None:
        return bool(_locked_math_verify_equal(*key, None))
    return bool(_run_with_deadline(*key, timeout))
