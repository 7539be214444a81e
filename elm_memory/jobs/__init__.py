"""Learn jobs: memories learned on or off the request path, from a durable job queue.

After ELM answers a question it *submits* the question here; learning a memory from it
(minutes of GRPO on a CPU) is the learner's job, not the request's. Four modes, chosen
by ``LearnerConfig.mode`` and built by :func:`build_learner` through the ``learners``
registry:

``sync`` (:mod:`~elm_memory.jobs.sync`)
    :meth:`SyncLearner.submit` runs the learning inline and returns when the memory is
    stored: the paper's strict online protocol (memory *i* exists before question *i+1*
    is answered). The job is still recorded in the queue first, so a crash mid-learning
    is resumed by the next learner that opens the queue.
``background`` (:mod:`~elm_memory.jobs.background`)
    :meth:`BackgroundLearner.submit` only records the job (one SQLite transaction, a few
    milliseconds) and wakes a daemon worker thread; it never waits for learning.
``ray`` (:mod:`~elm_memory.jobs.ray_learner`, :mod:`~elm_memory.jobs.ray_dispatch`; extra ``.[ray]``)
    :meth:`RayLearner.submit` records the job like ``background``; a dispatcher process sends
    batches of jobs to Ray actors on other machines (placed by ``num_gpus`` / ``num_cpus``), which
    write the memories to the shared store.
``off`` (:mod:`~elm_memory.jobs.off`)
    :class:`NoLearner`: nothing is learned or recorded.

The learning itself is an injected callable ``learn_fn(job) -> memory_id | None`` (and,
for batches, ``learn_many_fn``: :mod:`~elm_memory.jobs.queue_learner`); this package knows
nothing about torch models or stores. Where the rest lives: :mod:`~elm_memory.jobs.records`
(jobs, queue rows, tickets, job ids), :mod:`~elm_memory.jobs.queue` (the SQLite queue and
its durability), :mod:`~elm_memory.jobs.owners` (which worker holds a job, is it alive).

Idempotency contract ("every memory stored once")
-------------------------------------------------
* **Job identity.** ``job_id = sha256("elm-learn-v1", scope, namespace,
  sha256(question.strip()))`` (see :func:`make_job_id`; the inner hash is
  :func:`elm_memory.memory.ids.question_hash`). Submitting the same question in the same
  namespace (and scope) again returns the existing job instead of queueing a new one:
  ``pending``/``running`` -> the same job, not queued twice; ``done`` -> never rerun,
  the ticket carries the ``memory_id`` it produced and says ``reused`` (one log line says so too: the
  question's memory is reused, nothing is learned again); ``failed`` -> re-queued with fresh
  attempts (an explicit resubmission is the retry button). ``config_overrides`` are
  *not* part of the identity: a duplicate's overrides are ignored. ``scope`` should name
  what a memory is specific to (e.g. the model fingerprint), so switching models does
  not make the new model's memories look already learned.
* **Queue guarantee.** At most one worker holds a job at a time, and a ``done`` job is
  never claimed again: at most one *recorded* successful run per ``job_id``. A
  ``running`` job is only reclaimed once its owner is dead (by pid). The queue file is
  opened by processes of one host only (SQLite WAL does not work across hosts); learning on
  other machines is ``learner.mode: ray``, whose dispatcher on this host owns the file
  (:mod:`~elm_memory.jobs.ray_dispatch`).
* **The boundary.** ``learn_fn``'s store write and the queue's ``done`` commit are two
  systems: a crash after the store write but before the commit reruns the job on
  restart. ``learn_fn`` must therefore make its write idempotent on ``job.job_id``.
  Recommended: use ``job.job_id`` as the memory id (``memory.meta.id = job.job_id``
  before ``store.put``); the store upserts by id, so a rerun overwrites the same memory
  instead of adding a second one. Return that id; the queue records it as ``memory_id``.
"""

from elm_memory.jobs.background import BackgroundLearner
from elm_memory.jobs.learner import (
    LearnerFactory,
    LearnerOptions,
    LearnFn,
    LearnManyFn,
    MemoryLearner,
    build_learner,
)
from elm_memory.jobs.off import NoLearner
from elm_memory.jobs.owners import owner_is_alive
from elm_memory.jobs.queue import JobQueue
from elm_memory.jobs.queue_learner import QueueLearner
from elm_memory.jobs.records import (
    QUEUE_FILENAME,
    STATES,
    JobRecord,
    JobState,
    LearnerError,
    LearnJob,
    LearnTicket,
    TicketStatus,
    default_queue_path,
    make_job_id,
    ticket_summary,
)
from elm_memory.jobs.sync import SyncLearner

__all__ = [
    "QUEUE_FILENAME",
    "STATES",
    "BackgroundLearner",
    "JobQueue",
    "JobRecord",
    "JobState",
    "LearnFn",
    "LearnJob",
    "LearnManyFn",
    "LearnTicket",
    "LearnerError",
    "LearnerFactory",
    "LearnerOptions",
    "MemoryLearner",
    "NoLearner",
    "QueueLearner",
    "SyncLearner",
    "TicketStatus",
    "build_learner",
    "default_queue_path",
    "make_job_id",
    "owner_is_alive",
    "ticket_summary",
]
