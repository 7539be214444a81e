"""The names a store files memories under: namespaces, memory ids and question hashes; the question rule.

Kept free of torch and chromadb so the CLI can check its arguments before importing
either, and so the facade, the memory format and the store apply one rule each.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from elm_memory.errors import InvalidNamespaceError, InvalidQuestionError, MemoryFormatError

MAX_NAMESPACE_CHARS = 256
#: Memory ids are uuid4 hex (32) or learner job ids (sha256 hex, 64). Lowercase hex only:
#: an id becomes a file name on export, so it must never hold a path separator, "..",
#: or differ from another id only by case (case-insensitive file systems).
MEMORY_ID_RE = re.compile(r"[0-9a-f]{8,64}")
#: How many leading hex characters of a memory id listings show (like git's short ids); commands that take an
#: id accept any unique prefix of at least :data:`MIN_ID_PREFIX` characters.
SHORT_ID_CHARS = 12
MIN_ID_PREFIX = 4


def validate_namespace(namespace: Any) -> str:
    """Return ``namespace`` or raise :class:`InvalidNamespaceError` (the store's write-time rule).

    1-256 printable characters, no leading or trailing whitespace: a namespace is shown in
    listings and typed on command lines, where control characters or a stray space would
    silently name another namespace.
    """
    if not isinstance(namespace, str):
        raise InvalidNamespaceError(f"namespace must be text, got {type(namespace).__name__}")
    if not namespace:
        raise InvalidNamespaceError("namespace is empty; omit it to use the configured one")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise InvalidNamespaceError(f"namespace too long: {len(namespace)} characters (at most {MAX_NAMESPACE_CHARS})")
    if not namespace.isprintable() or namespace != namespace.strip():
        raise InvalidNamespaceError(
            f"invalid namespace {namespace[:40]!r}: use printable characters without leading or trailing spaces"
        )
    return namespace


def validate_memory_id(memory_id: Any) -> str:
    """Return ``memory_id`` or raise :class:`MemoryFormatError` (8-64 lowercase hex characters)."""
    if not isinstance(memory_id, str) or not MEMORY_ID_RE.fullmatch(memory_id):
        shown = memory_id[:40] if isinstance(memory_id, str) else memory_id
        raise MemoryFormatError(f"invalid memory id {shown!r}: expected 8-64 lowercase hex characters")
    return memory_id


def short_id(memory_id: str) -> str:
    """The first :data:`SHORT_ID_CHARS` characters of an id: what every listing shows."""
    return memory_id[:SHORT_ID_CHARS]


def question_hash(question: str) -> str:
    """sha256 of the stripped question: a memory's ``question_hash`` and the core of a learn job's id."""
    return hashlib.sha256(question.strip().encode("utf-8")).hexdigest()


def validate_question(question: Any) -> str:
    """Return the question as clean text or raise :class:`InvalidQuestionError`."""
    if isinstance(question, (bytes, bytearray)):
        try:
            question = bytes(question).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidQuestionError(f"question is not valid UTF-8 (byte {exc.start})") from None
    if not isinstance(question, str):
        raise InvalidQuestionError(f"question must be text, got {type(question).__name__}")
    try:
        question.encode("utf-8")  # argv with undecodable bytes arrives as lone surrogates
    except UnicodeEncodeError:
        raise InvalidQuestionError("question contains bytes that are not valid UTF-8") from None
    if "\x00" in question:
        raise InvalidQuestionError("question contains a NUL character")
    if not question.strip():
        raise InvalidQuestionError("question is empty")
    return question.strip()
