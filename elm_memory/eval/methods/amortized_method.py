"""``elm_amortized``: the graph's own stream turn (``stream.serving: amortized``), with the controls as extra rows.

Per question the evaluation runs :class:`~elm_memory.graph.stream_turn.StreamTurn` with ``measure=True``: the
turn draws what the product draws (by the gate's state and the probe hash) plus, in the same decode call, the rows
the product would not draw on that question: zero-shot's greedy answer and the samples when the memory answers
alone, and the untrained memory's greedy answer for a soft prompt. Only the product's rows decide the answer, the
gate and the update; every row is recorded with its answer and tokens, so anyone can recount:

- ``zero_shot``: zero-shot's greedy answer; ``self_consistency``: it and the samples, voted (the compute-matched
  baseline: k + 1 decodes); ``stream_greedy``: the memory's greedy answer on every question; ``init_greedy``: the
  untrained memory's (a LoRA's is zero-shot's, not decoded twice); ``elm_amortized``: the turn's answer;
- tokens per question for each (``self_consistency``: zero-shot's and the samples' together; ``elm_amortized``:
  the rows the product drew), the turn's mode, the gate's state, probe, the update and any gate decision.
"""

from __future__ import annotations

import logging
from typing import Any

from elm_memory.answers.vote import vote_counts
from elm_memory.backends.base import generate_requests
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput
from elm_memory.graph.nodes import answer_params
from elm_memory.graph.stream_turn import INIT, STREAM, ZERO_SHOT, StreamTurn
from elm_memory.training.stream import StreamMemory

#: Where the evaluation keeps its stream memory: ``<run>/stream/amortized/<namespace folder>/``.
AMORTIZED_DIR = "stream/amortized"

logger = logging.getLogger(__name__)


class AmortizedEval:
    """The amortized stream memory, one question at a time, every control read from the same decode call."""

    def __init__(self, runtime: EvalRuntime, name: str = "elm_amortized"):
        cfg = runtime.config
        if cfg.store.kind == "none":
            raise ConfigError(f"{name} keeps its stream memory on disk, but store.kind is 'none'; set store.kind")
        if cfg.stream.serving != "amortized":
            raise ConfigError(
                f"{name} measures stream.serving=amortized, but the config serves {cfg.stream.serving!r}: set "
                "stream.serving=amortized (the cpu-amortized preset does)"
            )
        if cfg.stream.tuning.clusters > 1:
            raise ConfigError(f"{name} evaluates one stream memory; set stream.tuning.clusters=1 for the evaluation")
        self.name = name
        self.runtime = runtime
        self._stream: StreamMemory | None = None
        self._pending: tuple[str, StreamTurn, Any] | None = None

    @property
    def stream(self) -> StreamMemory:
        if self._stream is None:
            rt = self.runtime
            root = rt.out_dir / AMORTIZED_DIR
            self._stream = StreamMemory(rt.config, rt.loaded, root, namespace=rt.config.namespace, backend=rt.backend)
        return self._stream

    @property
    def sampler(self) -> Any:
        from elm_memory.verifiers.consistency import ConsistencyVerifier

        return ConsistencyVerifier.from_config(self.runtime.config, self.runtime.backend)

    def answer(self, question: str, index: int) -> MethodOutput:
        rt, cfg = self.runtime, self.runtime.config
        prompt = rt.prompts.answer_prompt(question, memory_tokens=cfg.memory.num_tokens)
        params = answer_params(cfg, prompt, rt.backend.info.max_context)
        sampler = self.sampler
        turn = StreamTurn.plan(cfg, self.stream, question, cfg.namespace, measure=True)
        requests, greedy = turn.requests(cfg, self.stream, prompt, params, sampler)
        turn.read(generate_requests(rt.backend, requests), greedy)
        if turn.needs_fallback:  # measured: the vote's rows are there already, now spent
            turn.read_fallback(generate_requests(rt.backend, turn.fallback_requests(prompt, params, sampler)))
        self._pending = (question, turn, prompt)
        rows = {
            "zero_shot": turn.rows[ZERO_SHOT].answer,
            "self_consistency": turn.self_consistency(),
            "stream_greedy": turn.rows[STREAM].answer,
            "init_greedy": turn.rows[INIT].answer if INIT in turn.rows else turn.rows[ZERO_SHOT].answer,
            "elm_amortized": turn.answer,
        }
        tokens = turn.row_tokens()
        tokens["elm_amortized"] = tokens.pop("elm")
        if INIT in turn.rows:
            tokens["init_greedy"] = turn.rows[INIT].tokens
        counts = sorted((n for _, n, _ in vote_counts([rows["zero_shot"], *turn.sample_answers])), reverse=True)
        return MethodOutput(
            answer=turn.answer,
            response=turn.response,
            route=turn.mode or "",
            candidates=[
                {"kind": "zero_shot", "answer": rows["zero_shot"], "score": None},
                {"kind": "stream", "answer": rows["stream_greedy"], "score": None},
            ],
            extra={
                "amortized": {
                    "rows": rows,
                    "tokens": tokens,
                    "turn": turn.summary(),
                    "samples": turn.sample_answers,
                    "vote_share": (counts[0] if counts else 0) / (1 + len(turn.samples)),
                    "init_is_zero_shot": INIT not in turn.rows,
                    "gate_extra_tokens": _gate_extra_tokens(turn),
                }
            },
        )

    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != question:
            raise RuntimeError(f"{self.name}: learn() must follow answer() on the same question")
        _, turn, prompt = pending
        update = turn.learn(self.runtime.config, self.stream, prompt)
        extra = output.extra["amortized"]
        extra["update"] = update.to_dict() if update is not None else {"skipped": "not_probed", "version": turn.version}
        extra["gate_after"] = self.stream.read_gate_state()
        extra["gate_state"] = self.stream.files.read_gate()  # what a resume puts back (resume below)
        extra["pending_state"] = self.stream.pending_state()  # the guard's readings and the pool, likewise

    def resume(self, records: list[dict[str, Any]]) -> None:
        """A resumed run continues from its last record: the version it ended with (an update written after the last
        record, the process stopped between the two, is undone by a new version holding the recorded one), the
        guard's readings and pooled questions then, and the gate's state then (a question the gate or the guard read
        before the stop is answered again, and would be read twice)."""
        if not records:
            return
        last = max(records, key=lambda r: r["index"])
        extra = (last.get("extra") or {}).get("amortized") or {}
        recorded = extra.get("update", {}).get("version")
        stream = self.stream
        if recorded is not None and recorded != stream.version:
            stream.restore_version(int(recorded), reason="resume: the update after the last record was not recorded")
        if extra.get("pending_state") is not None:
            stream.restore_pending(extra["pending_state"])
        if extra.get("gate_state") is not None:
            stream.restore_gate(extra["gate_state"], reason="resume: a reading after the last record was not recorded")
            return
        # records from before the gate's state was recorded: say when the gate holds a reading they do not
        read, held = recorded_gate_readings(records), (stream.files.read_gate() or {}).get("total_readings", 0)
        if held > read:
            logger.warning(
                "%s: the gate holds %d readings but the records %d: a question read before the stop is read again "
                "(its records predate the gate's state in them); python -m benchmarks.gate_share_replay RUN replays "
                "the gate from the records alone",
                self.name,
                held,
                read,
            )

    def pool_stats(self) -> tuple[int, int]:
        from elm_memory.eval.methods.base import dir_bytes

        return (1 if self._stream is not None else 0), dir_bytes(self.runtime.out_dir / AMORTIZED_DIR)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.write_summary(self.runtime.out_dir / AMORTIZED_DIR / "summary.json")


def recorded_gate_readings(records: list[dict[str, Any]]) -> int:
    """How many of ``records`` say the gate read their question (a gate whose ``total_readings`` differs from this
    read a question the records do not account for)."""
    return sum(bool(((r.get("extra") or {}).get("amortized") or {}).get("update", {}).get("gate")) for r in records)


def _gate_extra_tokens(turn: StreamTurn) -> int:
    """Tokens the turn spent only for the gate: the memory's greedy answer while the vote answers, zero-shot's
    greedy answer on a probe while the memory answers (the samples teach the memory too)."""
    if turn.mode == "self_consistency":
        mine = turn.rows[STREAM]
        return mine.tokens if mine.spent else 0  # unspent: drawn for the measurement alone (gate_read_share < 1)
    if turn.mode == "memory_probe":
        return turn.rows[ZERO_SHOT].tokens
    return 0


def elm_amortized(runtime: EvalRuntime) -> AmortizedEval:
    return AmortizedEval(runtime)
