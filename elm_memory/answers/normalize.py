r"""Normalisation: the canonical string form of an answer, for the fast path of equivalence.

:func:`normalize_answer` drops whitespace (except the one ending a control word before a
letter, ``\pi r``), ``\left``/``\right``, spacing commands (``\! \, \; \: \quad``, ``~``),
``\displaystyle``, ``\$``, degree marks (``^\circ``, ``^{\circ}``, ``°``) and percent signs;
maps ``\dfrac``/``\tfrac`` to ``\frac`` and ``\frac34`` to ``\frac{3}{4}``; unwraps
``\text{...}`` (and ``\textbf``, ``\mbox``, ``\mathrm``, ...) and drops a trailing unit
(``5\text{ cm}`` -> ``5``); maps a parenthesised choice letter ``(B)`` to ``B``; removes
thousands separators only from a whole number written like ``1,234,567`` (``1{,}000``
too; ``1,2`` is left alone: it is a list); and writes decimals without trailing zeros
(``18.0`` -> ``18``, ``.5`` -> ``0.5``). Plain string work: no sympy, no state.
"""

from __future__ import annotations

import re

from elm_memory.answers.extract import clean_answer

_TEXT_CMD_NAMES = ("text", "textbf", "textrm", "textit", "textnormal", "mbox", "mathrm", "mathbf")
_TEXT_CMDS = "(?:" + "|".join(_TEXT_CMD_NAMES) + ")"
_TEXT_WRAPPER_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]*)\}")
# A unit: words (and "/", ".") in a text command at the very end, maybe squared/cubed.
_UNIT_TAIL_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{\s*[A-Za-z][A-Za-z ./]*\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*")
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


def _drop_unit(s: str) -> str:
    """Drop a trailing text unit after a value ("5\\text{ cm}^2"), but only when the value before
    it has no text of its own ("\\text{A} or \\text{B}" keeps its "B")."""
    at = max(s.rfind("\\" + name) for name in _TEXT_CMD_NAMES)
    if at > 0 and _UNIT_TAIL_RE.fullmatch(s, at):
        head = s[:at].rstrip()
        if head and not any("\\" + name in head for name in _TEXT_CMD_NAMES):
            return head
    return s


def _plain_number(s: str) -> str:
    """A choice letter without its parentheses, a whole number without thousands separators,
    a decimal without trailing zeros."""
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


def normalize_answer(answer: str) -> str:
    """Canonical string form used by the fast path and passed to math-verify."""
    s = clean_answer(answer)
    s = s.replace("−", "-").replace("\\$", "").replace("{,}", ",")
    s = _drop_unit(s)
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
    return _plain_number(clean_answer(s))
