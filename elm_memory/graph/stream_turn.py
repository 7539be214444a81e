"""One question's turn with a stream memory: which rows it draws, what it answers, what it learns. The graph's stream
nodes and the evaluation both run this object, so what is measured is what users run; the evaluation's controls are
extra rows on it (``measure``), drawn in the same decode call and never read by the answer, the gate or the update.

Rows (all at the answer's budget; the samples are the ``consistency`` verifier's seeded ones):

- ``stream.serving: vote``: zero-shot's greedy answer, the stream memory's, the samples (under the memory with
  ``learn_from: own``), and in ``both`` mode the retrieved memory's; the answer is the vote of the memory's greedy
  answer and the samples (and the retrieved memory's).
- ``stream.serving: amortized``, gate closed (warm-up, probation): zero-shot's greedy answer, the samples (without
  the memory) and the memory's greedy answer; the answer is self-consistency's vote (zero-shot + samples). The
  memory's answer costs one row more and is what the gate and the collapse guard read; with
  ``stream.tuning.gate_read_share`` below 1 only that share of questions (picked by a hash, as probes are) draws it.
- ``amortized``, gate open: the memory's greedy answer answers alone. A share ``stream.probe_share`` of questions,
  picked by a hash of the question (the same question is always, or never, a probe), also draws zero-shot's
  answer and the samples: the gate reads them and the memory learns from them. A memory answer with no
  ``\\boxed{}`` falls back to the vote (a second decode call), which the memory learns from but the gate ignores
  (the gate reads only probes, a random share).

Every turn counts the tokens it generated for the answer (``tokens``: the rows the product drew, not the
measurement's) beside each row's own count.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from elm_memory.answers import equivalent, extract_answer
from elm_memory.answers.vote import plurality_vote, vote_margin
from elm_memory.backends.base import GenerateRequest, PromptInput, SamplingParams
from elm_memory.config import ELMConfig
from elm_memory.errors import ConfigError
from elm_memory.memory.ids import question_hash
from elm_memory.training.stream import StreamMemory, StreamUpdate
from elm_memory.training.stream_gate import SERVING, GateReading
from elm_memory.training.stream_samples import Generated, answer_budget_samples

#: What a turn answered with (``StreamTurn.mode``).
VOTE_MODE = "vote"  # serving vote: the memory's greedy answer and the samples
SELF_CONSISTENCY = "self_consistency"  # amortized, gate closed: zero-shot's greedy answer and the samples
MEMORY = "memory"  # amortized, gate open: the memory's greedy answer alone
MEMORY_PROBE = "memory_probe"  # the same, on a probe question (the vote drawn beside it)
FALLBACK = "memory_fallback"  # the memory's answer had no \boxed{}: the vote answered

#: Row names.
ZERO_SHOT, STREAM, RETRIEVED, INIT = "zero_shot", "stream", "memory", "init"


def is_probe(question: str, seed: int | None, share: float) -> bool:
    """Whether ``question`` is one of the ``share`` of questions that draw the vote while the gate is open: a hash of
    the question and the seed, so a repeated question is picked alike and the evaluation's extra rows change nothing."""
    if share >= 1.0:
        return True
    digest = question_hash(f"{seed or 0}:{question}")
    return int(digest[:12], 16) / float(16**12) < share


@dataclasses.dataclass
class Row:
    """One greedy row: its answer, text and tokens, and whether the product drew it (``spent``) or only the
    evaluation did."""

    answer: str | None
    text: str
    token_ids: list[int]
    finish_reason: str
    spent: bool

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, gen: Any, spent: bool) -> Row:
        """A backend's generation as a row, its ``\\boxed{}`` answer extracted."""
        return cls(
            answer=extract_answer(gen.text),
            text=gen.text,
            token_ids=list(gen.token_ids),
            finish_reason=str(gen.finish_reason),
            spent=spent,
        )


@dataclasses.dataclass
class StreamTurn:
    """A question's turn (JSON in the graph's state between nodes: :meth:`to_state`, :meth:`from_state`)."""

    question: str
    namespace: str
    serving: str
    gate_state: str
    probe: bool
    version: int
    measure: bool = False
    gate_read: bool = True  # the memory's greedy answer is drawn for the gate (False: a closed gate skips this one)
    rows: dict[str, Row] = dataclasses.field(default_factory=dict)
    samples: list[Row] = dataclasses.field(default_factory=list)
    samples_spent: bool = False
    samples_under_memory: bool = False
    mode: str | None = None
    answer: str | None = None
    response: str = ""
    # the turn's own id: a graph resumed from its checkpoint re-runs the learn node, which must not learn twice
    turn_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])

    # -- planning --------------------------------------------------------------------------
    @classmethod
    def plan(cls, config: ELMConfig, stream: StreamMemory, question: str, namespace: str, *, measure: bool = False):
        """The turn's plan from the config and the gate's state now."""
        s = config.stream
        gate = stream.read_gate_state() if s.serving == "amortized" else "off"
        probe = s.serving == "vote" or gate != SERVING or is_probe(question, config.training.seed, s.probe_share)
        closed = s.serving == "amortized" and gate != SERVING
        read = not closed or is_probe(question, config.training.seed, s.tuning.gate_read_share)
        return cls(
            question=question,
            namespace=namespace,
            serving=s.serving,
            gate_state=gate,
            probe=probe,
            version=stream.version,
            measure=measure,
            gate_read=read,
        )

    @property
    def memory_alone(self) -> bool:
        """The memory's greedy answer answers (amortized, gate open)."""
        return self.serving == "amortized" and self.gate_state == SERVING

    def requests(
        self,
        config: ELMConfig,
        stream: StreamMemory,
        prompt: Any,
        params: SamplingParams,
        sampler: Any,
        extra: list[PromptInput] | None = None,
    ) -> tuple[list[GenerateRequest], list[tuple[str, bool]]]:
        """The first decode call's requests, and the greedy rows' (name, spent) in order; the samples come last."""
        zero, at = prompt.zero_shot(), prompt.memory_at
        greedy: list[tuple[str, bool]] = []
        inputs: list[PromptInput] = []
        if self.gate_read or self.measure:
            greedy.append((STREAM, self.gate_read))
            inputs += stream.serve([zero], at)
        vote_rows = self.probe or self.measure
        if vote_rows:
            greedy.append((ZERO_SHOT, self.probe))
            inputs.append(zero)
        if extra:
            if len(extra) > 1:
                raise ConfigError(f"a stream turn takes the top-1 retrieved memory's row, got {len(extra)} rows")
            greedy.append((RETRIEVED, True))
            inputs += extra
        if self.measure and not stream.init_is_base_model:  # the untrained memory: the ablation of training
            greedy.append((INIT, False))
            inputs += stream.serve_init([zero], at)
        requests: list[GenerateRequest] = [(inputs, params)]
        if vote_rows:
            samples, sample_params = answer_budget_samples(sampler, self.question, prompt, params)
            self.samples_under_memory = self.serving == "vote" and config.stream.tuning.learn_from == "own"
            if self.samples_under_memory:
                samples = stream.serve(samples, at)
            self.samples_spent = self.probe
            requests.append((samples, sample_params))
        return requests, greedy

    def read(self, generated: list[list[list[Any]]], greedy: list[tuple[str, bool]]) -> None:
        """Take the first call's generations and decide the answer (unless it needs the fallback's rows)."""
        for (name, spent), [gen] in zip(greedy, generated[0], strict=True):
            self.rows[name] = Row.of(gen, spent)
        if len(generated) > 1:
            self.samples = [Row.of(g, self.samples_spent) for gens in generated[1] for g in gens]
        if not self.needs_fallback:
            self._decide()

    @property
    def needs_fallback(self) -> bool:
        """Amortized with the gate open, the memory gave no boxed answer, and the vote's rows were not spent."""
        return self.memory_alone and self.rows[STREAM].answer is None and not self.samples_spent

    def fallback_requests(self, prompt: Any, params: SamplingParams, sampler: Any) -> list[GenerateRequest]:
        """The vote's rows for the fallback (none when the evaluation drew them already: then they become spent)."""
        if self.samples:  # measured: drawn in the first call
            return []
        samples, sample_params = answer_budget_samples(sampler, self.question, prompt, params)
        return [([prompt.zero_shot()], params), (samples, sample_params)]

    def read_fallback(self, generated: list[list[list[Any]]]) -> None:
        if generated:
            self.rows[ZERO_SHOT] = Row.of(generated[0][0][0], True)
            self.samples = [Row.of(g, True) for gens in generated[1] for g in gens]
        self.rows[ZERO_SHOT].spent = True
        for s in self.samples:
            s.spent = True
        self.samples_spent = True
        self.mode = FALLBACK
        self._decide()

    # -- the answer ------------------------------------------------------------------------
    @property
    def sample_answers(self) -> list[str | None]:
        return [s.answer for s in self.samples]

    def self_consistency(self) -> str | None:
        """Zero-shot's greedy answer and the samples, voted (the baseline; amortized's closed-gate answer)."""
        zero = self.rows.get(ZERO_SHOT)
        return plurality_vote(self.sample_answers, zero.answer if zero else None, with_greedy=True)

    def _decide(self) -> None:
        mine = self.rows.get(STREAM) or self.rows[ZERO_SHOT]  # a closed gate's turn may not draw the memory's
        if self.serving == "vote":
            retrieved = [self.rows[RETRIEVED]] if RETRIEVED in self.rows else []
            votes = self.sample_answers + [r.answer for r in retrieved]
            self.answer = plurality_vote(votes, mine.answer, with_greedy=True)
            voters = [mine, *self.samples, *retrieved]
            self.mode = VOTE_MODE
        elif self.memory_alone and self.mode != FALLBACK:
            self.answer, self.response = mine.answer, mine.text
            self.mode = MEMORY_PROBE if self.probe else MEMORY
            return
        else:
            self.answer = self.self_consistency()
            voters = [self.rows[ZERO_SHOT], *self.samples]
            self.mode = self.mode or SELF_CONSISTENCY
        self.response = next(
            (r.text for r in voters if self.answer is not None and equivalent(r.answer, self.answer)), mine.text
        )

    @property
    def tokens(self) -> int:
        """Tokens generated for this answer: the rows the product drew (not the evaluation's extra rows)."""
        return sum(r.tokens for r in self.rows.values() if r.spent) + sum(s.tokens for s in self.samples if s.spent)

    def row_tokens(self) -> dict[str, int]:
        """Each method's tokens on this question, from the rows drawn: zero-shot, self-consistency (zero-shot and
        the samples), the memory's greedy answer, and this turn's answer."""
        out = {"elm": self.tokens}
        if STREAM in self.rows:
            out["stream_greedy"] = self.rows[STREAM].tokens
        if ZERO_SHOT in self.rows:
            out["zero_shot"] = self.rows[ZERO_SHOT].tokens
            if self.samples and not self.samples_under_memory:
                out["self_consistency"] = out["zero_shot"] + sum(s.tokens for s in self.samples)
        return out

    # -- learning --------------------------------------------------------------------------
    def learn(self, config: ELMConfig, stream: StreamMemory, prompt: Any) -> StreamUpdate | None:
        """Update the stream memory from this turn's spent rows (None: the turn drew nothing to learn from, a
        non-probe question with the gate open)."""
        mine, zero = self.rows.get(STREAM), self.rows.get(ZERO_SHOT)
        drawn = [Generated(s.token_ids, s.answer, sampled=True) for s in self.samples if s.spent]
        if self.serving == "vote":
            assert zero is not None and mine is not None
            if config.stream.tuning.learn_from == "own":
                generations = [Generated(mine.token_ids, mine.answer, sampled=False), *drawn]
                label, served = self.answer, None
            else:  # zero-shot's rows and their vote (self-consistency's); the guard watches the memory's answer
                generations = [Generated(zero.token_ids, zero.answer, sampled=False), *drawn]
                label, served = self.self_consistency(), [mine.answer]
            reading, margin = None, 1.0
        else:
            if not drawn or zero is None or not zero.spent:
                return None
            generations = [Generated(zero.token_ids, zero.answer, sampled=False), *drawn]
            read = mine if self.gate_read else None  # drawn for the measurement alone: nothing reads it
            label, served = self.self_consistency(), [read.answer] if read is not None else []
            margin = vote_margin([zero.answer, *self.sample_answers])
            # the gate reads probes only: the fallback's questions are the ones the memory failed on
            reading = GateReading.of(read.answer, zero.answer, self.sample_answers) if self.probe and read else None
        return stream.learn(
            self.question,
            prompt.token_ids,
            prompt.memory_at,
            generations,
            label=label,
            version_used=self.version,
            zero_shot_answer=zero.answer if zero is not None else None,
            served_answers=served,
            gate_reading=reading,
            margin=margin,
            turn=self.turn_id,
        )

    # -- JSON --------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What a result shows of the turn: mode, gate, probe, version and tokens."""
        return {
            "mode": self.mode,
            "serving": self.serving,
            "gate": self.gate_state,
            "probe": self.probe,
            "version": self.version,
            "tokens": self.tokens,
        }

    def to_state(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamTurn:
        data = dict(state)
        data["rows"] = {k: Row(**v) for k, v in data.get("rows", {}).items()}
        data["samples"] = [Row(**v) for v in data.get("samples", [])]
        return cls(**data)
