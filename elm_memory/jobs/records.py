"""What the job queue stores and hands out: a learn job, its row in the queue, a submit ticket.

Plain frozen dataclasses, no I/O: the queue (:mod:`elm_memory.jobs.queue`) persists them and
the learners (:mod:`elm_memory.jobs.learner`) pass them to ``learn_fn`` and back to callers.
The job id is derived from the question, so the same question is one job (see the package
docstring for the idempotency contract).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from elm_memory.errors import ELMError, InvalidQuestionError
from elm_memory.memory.ids import question_hash

JobState = Literal["pending", "running", "done", "failed"]
TicketStatus = Literal["pending", "running", "done", "failed", "skipped"]
STATES: tuple[JobState, ...] = ("pending", "running", "done", "failed")
TERMINAL = frozenset({"done", "failed"})

QUEUE_FILENAME = "learner.sqlite3"
_ID_PREFIX = "elm-learn-v1"  # versions the id scheme: a new scheme must not collide with stored ids


class LearnerError(ELMError):
    """The learner is closed, its queue file is unusable, or a job id is unknown."""


def error_text(exc: BaseException, limit: int = 2000) -> str:
    """A failed attempt's error as the ledger keeps it: ``Type: message``, cut at ``limit`` characters."""
    error = f"{type(exc).__name__}: {exc}"
    return error if len(error) <= limit else error[:limit] + " [...]"


def make_job_id(question: str, namespace: str, scope: str = "") -> str:
    """Deterministic job id: same (scope, namespace, stripped question) -> same id."""
    payload = "\x00".join((_ID_PREFIX, scope, namespace, question_hash(question)))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def default_queue_path(store_path: str | os.PathLike[str]) -> Path:
    """Where the queue lives for a store folder: ``<store path>/learner.sqlite3``."""
    return Path(store_path).expanduser() / QUEUE_FILENAME


@dataclass(frozen=True)
class LearnJob:
    """One question to learn a memory from: what ``learn_fn`` receives.

    ``attempts`` is the number of this run (1 for the first) when handed to ``learn_fn``.
    """

    job_id: str
    question: str
    namespace: str
    submitted_at: float
    attempts: int = 0
    config_overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def create(
        cls,
        question: str,
        namespace: str = "default",
        *,
        scope: str = "",
        config_overrides: dict[str, Any] | None = None,
    ) -> LearnJob:
        if not isinstance(question, str) or not question.strip():
            raise InvalidQuestionError("a learn job needs a non-empty question string")
        if not isinstance(namespace, str) or not namespace:
            raise LearnerError("a learn job needs a non-empty namespace string")
        overrides = _json_copy(config_overrides or {})
        if not isinstance(overrides, dict):
            raise LearnerError("config_overrides must be a mapping")
        return cls(
            job_id=make_job_id(question, namespace, scope),
            question=question,
            namespace=namespace,
            submitted_at=time.time(),
            config_overrides=overrides,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LearnJob:
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> LearnJob:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class JobRecord:
    """A job and where it stands in the queue."""

    job: LearnJob
    state: JobState
    memory_id: str | None = None
    error: str | None = None  # last failed attempt's error (kept while retrying)
    owner: str | None = None  # who runs it (host|pid|start|token) while running
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LearnTicket:
    """What ``submit`` returns: the job id and its status at return time."""

    job_id: str
    status: TicketStatus
    memory_id: str | None = None
    error: str | None = None
    attempts: int = 0
    duplicate: bool = False  # the job already existed (nothing new was queued)

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def reused(self) -> bool:
        """The question was learned before (same namespace and scope): no new memory was learned, and
        ``memory_id`` is the one it already has."""
        return self.duplicate and self.status == "done"

    @classmethod
    def from_record(cls, rec: JobRecord, *, duplicate: bool = False) -> LearnTicket:
        return cls(rec.job_id, rec.state, rec.memory_id, rec.error, rec.job.attempts, duplicate)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ticket_summary(ticket: Any) -> dict[str, Any]:
    """What an answer reports of its learn job (the graph's ``learn_job``): id, status, memory id, and
    whether the question was already learned (``reused``: ``memory_id`` is the memory it already has) or
    already queued (``duplicate``). Takes any ticket-like object (a plugin learner's)."""
    return {
        "job_id": ticket.job_id,
        "status": ticket.status,
        "memory_id": ticket.memory_id,
        "duplicate": bool(getattr(ticket, "duplicate", False)),
        "reused": bool(getattr(ticket, "reused", False)),
    }


def _json_copy(value: Any) -> Any:
    # a deep copy that also proves the overrides survive the queue's JSON column
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise LearnerError(f"config_overrides must be JSON-serialisable: {exc}") from None
