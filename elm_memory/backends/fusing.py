"""Run a few independent parts of one job in threads whose ``generate`` calls share decode batches.

The online protocol answers a question and then learns a memory from it. The two do not depend
on each other (a memory is learned from the question, with no answer and no gold), and on a CPU
each is mostly a decode loop at a tiny batch: the memory-conditioned answer is one greedy row,
the first training step's rollouts are G sampled rows. A decode step costs nearly the same for 5
rows as for 1 (see :mod:`elm_memory.backends.decode`), so decoding them as one batch saves most
of one of the two.

:meth:`FusedCalls.run` runs the first part in the calling thread and the others in new threads,
all against :attr:`FusedCalls.backend`, a view of the wrapped backend. A part's ``generate`` (or
``generate_many``: several calls of one part, e.g. the answers and a verifier's samples) waits until
every part still running is waiting in one too (or has finished); then all waiting calls go to the
backend's ``generate_many`` as one batch. Deterministic, no timing window: the batch forms when
nobody else can add to it, and its calls go in the parts' order, not the order the threads reached
it (the same rows in another order can sample differently). Batches always decode in the calling
thread: the same decode was measured slower in a freshly started thread than in the main one
(docs/LOG.md), so the caller should pass its heaviest part first.
Outside :meth:`run`, or from any other thread, the view calls straight through.

An interrupt (Ctrl-C: ``KeyboardInterrupt``, or ``SystemExit``) reaches the calling thread only.
It ends the run for every part: calls waiting for a batch and every later call raise
``KeyboardInterrupt`` in their parts' threads, so nobody decodes on after the user asked to stop
(before, the other parts' decoding went on to their end, minutes on a CPU), and the interrupt is raised
once they have ended. An ordinary exception in one part only takes that part out of the batch.

A backend that does not batch calls (no ``batches_calls`` and ``generate_many``; e.g. the vLLM
backends, whose engine batches by itself and is not driven from several threads here) runs the
parts one after another, in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elm_memory.backends.base import GenerateRequest, Generation, PromptLike, SamplingParams, generate_requests

_INTERRUPTS = (KeyboardInterrupt, SystemExit)  # the user stopping the run, not a part failing


@dataclass
class _Call:
    """One part's ``generate``/``generate_many`` call: its requests, decoded with the batch's others."""

    requests: Sequence[GenerateRequest]
    part: int = 0  # the batch's rows follow the parts' order, whatever order the threads arrived in
    result: list[list[list[Generation]]] | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class FusionStats:
    """What fusing did, for benchmarks and tests: batches run and the calls each held."""

    batches: list[int] = field(default_factory=list)  # requests per batch sent to generate_many


class FusedView:
    """The backend as the parts see it: ``generate`` joins the current fused batch from a part's
    thread, and calls straight through otherwise. Everything else is the wrapped backend's."""

    def __init__(self, owner: FusedCalls):
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner.inner, name)

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        return self._owner.generate_many([(prompts, params)])[0]

    def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[list[Generation]]]:
        """Several calls of one part (e.g. the answers and the verifier's samples), in the same batch."""
        return self._owner.generate_many(requests)


class FusedCalls:
    """Wraps a backend; :meth:`run` executes parts whose ``generate`` calls are batched together."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.backend = FusedView(self)
        self.stats = FusionStats()
        self._cond = threading.Condition()
        self._active: set[int] = set()  # parts still running in the current run()
        self._pending: list[_Call] = []
        self._local = threading.local()
        self._run_lock = threading.Lock()  # one run() at a time
        self._driver: int | None = None  # the thread that called run(): the only one that decodes batches
        self._interrupted = False  # the caller was interrupted: every part's call now raises

    @property
    def can_fuse(self) -> bool:
        """The backend says it batches calls (``batches_calls``; a wrapper such as the evaluation's greedy
        cache passes its backend's answer through) and has ``generate_many``."""
        many = getattr(self.inner, "generate_many", None)
        return bool(getattr(self.inner, "batches_calls", False)) and callable(many)

    def run(self, parts: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each part's return value, in order; the first failing part's exception is raised after all
        have ended (a failed part leaves the fused batch, so it never blocks the others)."""
        if not self.can_fuse or len(parts) < 2:
            return [part() for part in parts]
        results: list[Any] = [None] * len(parts)
        errors: list[BaseException | None] = [None] * len(parts)

        def work(i: int) -> None:
            self._local.part = i
            try:
                results[i] = parts[i]()
            except BaseException as exc:  # re-raised in the caller's thread below
                errors[i] = exc
            finally:
                self._local.part = None
                with self._cond:
                    self._active.discard(i)
                    self._cond.notify_all()

        with self._run_lock:
            with self._cond:
                self._active = set(range(len(parts)))
                self._driver = threading.get_ident()
            threads = [threading.Thread(target=work, args=(i,), name=f"elm-fused-{i}") for i in range(1, len(parts))]
            for t in threads:
                t.start()
            try:
                work(0)
                if isinstance(errors[0], _INTERRUPTS):
                    raise errors[0]
                with self._cond:  # the first part is done: decode the others' batches until they end
                    while self._active:
                        if not self._decode_ready():
                            self._cond.wait()
            except _INTERRUPTS:
                self._interrupt()
                raise
            finally:
                for t in threads:
                    t.join()
                with self._cond:
                    self._driver, self._interrupted, self._pending = None, False, []
        for exc in errors:
            if exc is not None:
                raise exc
        return results

    def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[list[Generation]]]:
        if getattr(self._local, "part", None) is None:
            return generate_requests(self.inner, requests)
        call = _Call(list(requests), part=self._local.part)
        driver = threading.get_ident() == self._driver
        with self._cond:
            if self._interrupted:
                raise KeyboardInterrupt("the fused run was interrupted")
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                if not (driver and self._decode_ready()):
                    self._cond.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _interrupt(self) -> None:
        """The caller was interrupted: fail the calls waiting for a batch and every later one, so the other
        parts end now instead of decoding on (only the calling thread decodes, so none is mid-batch).
        Takes the lock: call it without holding it."""
        with self._cond:
            self._interrupted = True
            for call in self._pending:
                call.error, call.done = KeyboardInterrupt("the fused run was interrupted"), True
            self._pending = []
            self._cond.notify_all()

    def _decode_ready(self) -> bool:
        """In the calling thread, holding the lock: if every running part waits in ``generate``, decode
        their calls (lock released meanwhile) and return True."""
        if not self._pending or len(self._pending) != len(self._active):
            return False
        # part order, not arrival order: rows in another place can decode differently (a lookup draft is
        # the latest match among the rows, and the batched forward rounds by layout), so a run whose threads
        # arrived in another order would learn another memory
        batch, self._pending = sorted(self._pending, key=lambda c: c.part), []
        self._cond.release()
        try:
            self._decode(batch)
        finally:
            self._cond.acquire()
        self._cond.notify_all()
        return True

    def _decode(self, batch: list[_Call]) -> None:
        try:
            requests = [r for c in batch for r in c.requests]
            results = iter(generate_requests(self.inner, requests))
            self.stats.batches.append(len(requests))
            for c in batch:
                c.result = [next(results) for _ in c.requests]
        except BaseException as exc:  # every call of the batch gets it
            if isinstance(exc, _INTERRUPTS):
                self._interrupt()  # and the calls that joined meanwhile, and every later one: the run is over
            for c in batch:
                c.error = exc
        finally:
            for c in batch:
                c.done = True
