"""``elm_stream``: the stream memory online (``stream.serving: vote``), every control from the same decode call.

The first arm is the graph's own turn (:class:`~elm_memory.graph.stream_turn.StreamTurn`): the rows it draws, the
answer, the label, what the collapse guard reads and the update are the ones users run. Everything else is an extra
request of the same decode call, with the same per-sample seeds where rows are sampled, and read by no decision:

- the samples the turn did not draw: without the memory (self-consistency's, with ``learn_from: own``) or under it
  (the memory's own vote, with ``learn_from: zero_shot``);
- the stream memory's **untrained init**, greedy (the ablation of training; a LoRA stream memory's init is the
  base model itself, B = 0, so its answer is zero-shot's and is not decoded twice);
- the question with the one-sentence format instruction appended, greedy (``zero_shot_format``);
- per further arm, its greedy answer and the same k samples under its serving version.

The method's answer is the turn's: with ``learn_from: own`` the vote of the memory's greedy answer and its samples
(the compute of self-consistency, k + 1 generations), which is also its label; with ``learn_from: zero_shot`` the
memory's greedy answer voting among the zero-shot samples (``stream_zs_vote``), while it learns from zero-shot's
rows labelled by self-consistency's vote and the guard reads its greedy answer alone. Further arms learn by the
same rule from their own rows.

Every row's answer, the tokens of the main rows, the versions used and each update are in the record's ``extra``
(read by :mod:`elm_memory.eval.stream_report`), so anyone can recount what decided each answer.

``elm_stream`` trains ``stream.tuning.objective``; ``elm_stream_objectives`` trains a ``grpo`` and an ``sft`` arm side
by side on the same questions (the rows they share are decoded once). ``elm_stream_gold`` trains a ``grpo`` arm on
the vote beside a ``grpo_gold`` arm whose label is the dataset's answer: an **upper bound** (what the same update
does with a correct label), reported apart and never a method a user runs without ground truth. The gold label
reaches that arm only after the question's answers were drawn (:meth:`StreamEval.teach_gold`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import ValidationError

from elm_memory.answers.vote import plurality_vote
from elm_memory.backends.base import GenerateRequest, PromptInput, generate_requests
from elm_memory.config.stream import StreamConfig
from elm_memory.errors import ConfigError
from elm_memory.eval.methods.base import EvalRuntime, MethodOutput
from elm_memory.eval.methods.baselines import ZeroShot
from elm_memory.graph.nodes import answer_params
from elm_memory.graph.stream_turn import INIT, STREAM, ZERO_SHOT, Row, StreamTurn
from elm_memory.training.stream import StreamMemory
from elm_memory.training.stream_samples import Generated, answer_budget_samples

#: Where an evaluation keeps its stream memories: ``<run>/stream/<objective>/<namespace folder>/``.
STREAM_DIR = "stream"


def format_question(question: str, instruction: str) -> str:
    """The question with the format instruction as its last sentence (what ``zero_shot_format`` answers)."""
    return f"{question}\n{instruction}"


class ZeroShotFormat(ZeroShot):
    """Greedy zero-shot with ``stream.tuning.format_instruction`` appended to the question: does one sentence do
    what a trained stream memory does?"""

    name = "zero_shot_format"

    def _prompt(self, question: str) -> PromptInput:
        k = self.runtime.config.memory.num_tokens
        text = format_question(question, self.runtime.config.stream.tuning.format_instruction)
        return self.runtime.prompts.answer_prompt(text, memory_tokens=k).zero_shot()

    def resume(self, records: list[dict[str, Any]]) -> int:
        return 0  # its prompt is its own: nothing another method would reuse


LABEL_SOURCES = ("vote", "gold")


#: What an arm may set for itself: how and from what it learns. Not ``kind``: the run's untrained-init row is one.
ARM_SETTINGS = (
    "learn_from",
    "learning_rate",
    "min_label_share",
    "update_every",
    "max_grad_norm",
    "replay",
    "replay_buffer",
    "replay_samples",
)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One trained stream memory of an evaluation: its row name, objective, where its label comes from
    (``vote``: the vote of the rows it learns from, the product's rule; ``gold``: the dataset's answer), and
    ``settings``: ``stream`` and ``stream.tuning`` fields of its own (:data:`ARM_SETTINGS`), the run's config for
    the rest."""

    name: str
    objective: str
    label: str = "vote"
    settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.label not in LABEL_SOURCES:
            raise ConfigError(f"stream arm {self.name!r}: label must be one of {LABEL_SOURCES}, got {self.label!r}")
        unknown = sorted({k for k, _ in self.settings} - set(ARM_SETTINGS))
        if "objective" in unknown:
            raise ConfigError(f"stream arm {self.name!r}: its objective is Arm.objective, not a setting")
        if unknown:
            raise ConfigError(
                f"stream arm {self.name!r}: {', '.join(unknown)} cannot differ between arms; an arm may set "
                f"{', '.join(ARM_SETTINGS)}"
            )

    def stream_config(self, base: StreamConfig) -> StreamConfig:
        """The run's ``stream`` section with this arm's objective and settings (validated as a whole): each setting
        where it lives, ``learning_rate`` in ``stream``, the rest in ``stream.tuning``."""
        own = dict(self.settings)
        top = {k: own.pop(k) for k in list(own) if k in StreamConfig.model_fields}
        data = base.model_dump()
        data["tuning"] = {**data["tuning"], **own, "objective": self.objective}
        try:
            return StreamConfig.model_validate({**data, **top})
        except ValidationError as exc:
            raise ConfigError(f"stream arm {self.name!r}: {exc.errors()[0]['msg']}") from None


class StreamEval:
    """The stream memory (one or more trained arms) beside its controls, one question at a time."""

    def __init__(
        self,
        runtime: EvalRuntime,
        objectives: list[str] | None = None,
        name: str = "elm_stream",
        arms: list[Arm] | None = None,
    ):
        cfg = runtime.config
        if cfg.store.kind == "none":
            raise ConfigError(f"{name} keeps its stream memory on disk, but store.kind is 'none'; set store.kind")
        if cfg.stream.serving != "vote":
            raise ConfigError(
                f"{name} measures stream.serving=vote, but the config serves {cfg.stream.serving!r}: run elm_amortized "
                "for the amortized stream memory, or set stream.serving=vote"
            )
        if cfg.stream.tuning.clusters > 1:  # the graph's option; every row here reads one memory per arm
            raise ConfigError(
                f"{name} evaluates one stream memory per arm; stream.tuning.clusters={cfg.stream.tuning.clusters} is "
                "served by "
                "the graph only: set stream.tuning.clusters=1 for the evaluation"
            )
        self.name = name
        self.runtime = runtime
        self.specs = arms or [Arm(obj, obj) for obj in objectives or [cfg.stream.tuning.objective]]
        if self.specs[0].label != "vote":
            raise ConfigError(f"{name}: the first arm answers, so its label must be the vote")
        self.objectives = [a.name for a in self.specs]
        if len(set(self.objectives)) != len(self.objectives):
            raise ConfigError(f"{name}: stream arms need distinct names, got {self.objectives}")
        # each arm's whole config: the run's, with the arm's stream section
        self._configs = {a.name: cfg.model_copy(update={"stream": a.stream_config(cfg.stream)}) for a in self.specs}
        self._arms: dict[str, StreamMemory] | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def uses_gold(self) -> bool:
        """Whether an arm learns from the dataset's answer (the online loop then calls :meth:`teach_gold`)."""
        return any(a.label == "gold" for a in self.specs)

    @property
    def arms(self) -> dict[str, StreamMemory]:
        if self._arms is None:
            rt, cfg = self.runtime, self.runtime.config
            self._arms = {}
            for spec in self.specs:
                root = rt.out_dir / STREAM_DIR / spec.name
                self._arms[spec.name] = StreamMemory(
                    self._configs[spec.name], rt.loaded, root, namespace=cfg.namespace, backend=rt.backend
                )
        return self._arms

    def teach_gold(self, question: str, gold: str) -> None:
        """The dataset's answer, after :meth:`answer` drew every row and before :meth:`learn`: the label of the
        ``gold`` arms (upper bounds). The answer already returned did not see it."""
        if self._pending is None or self._pending["question"] != question:
            raise RuntimeError(f"{self.name}: teach_gold() must follow answer() on the same question")
        for spec in self.specs:
            if spec.label == "gold":
                self._pending["labels"][spec.name] = gold

    @property
    def sampler(self) -> Any:
        from elm_memory.verifiers.consistency import ConsistencyVerifier

        return ConsistencyVerifier.from_config(self.runtime.config, self.runtime.backend)

    # -- answering -----------------------------------------------------------------------
    def answer(self, question: str, index: int) -> MethodOutput:
        rt, cfg = self.runtime, self.runtime.config
        k = cfg.memory.num_tokens
        t0 = time.perf_counter()
        prompt = rt.prompts.answer_prompt(question, memory_tokens=k)
        params = answer_params(cfg, prompt, rt.backend.info.max_context)
        formatted = rt.prompts.answer_prompt(
            format_question(question, cfg.stream.tuning.format_instruction), memory_tokens=k
        )
        format_params = answer_params(cfg, formatted, rt.backend.info.max_context)
        sampler = self.sampler
        arms, first = self.arms, self.objectives[0]
        lead, lead_config = arms[first], self._configs[first]
        versions = {obj: arm.version for obj, arm in arms.items()}
        # the first arm is the product's turn; everything else is an extra request of the same decode call
        turn = StreamTurn.plan(lead_config, lead, question, cfg.namespace, measure=True)
        requests, turn_rows = turn.requests(lead_config, lead, prompt, params, sampler)
        samples, sample_params = answer_budget_samples(sampler, question, prompt, params)
        zero, at = prompt.zero_shot(), prompt.memory_at
        controls: dict[str, GenerateRequest] = {"format": ([formatted.zero_shot()], format_params)}
        # the turn draws the samples one way (under the memory with learn_from own, else without); the other way
        # is a control: self-consistency's samples, or the memory's own vote
        other_samples = ZERO_SHOT if turn.samples_under_memory else first
        controls[f"samples[{other_samples}]"] = (
            (samples if other_samples == ZERO_SHOT else lead.serve(samples, at)),
            sample_params,
        )
        for obj, arm in arms.items():
            if obj != first:
                controls[f"greedy[{obj}]"] = (arm.serve([zero], at), params)
                controls[f"samples[{obj}]"] = (arm.serve(samples, at), sample_params)
        all_requests = requests + list(controls.values())
        generated = generate_requests(rt.backend, all_requests)
        turn.read(generated[: len(requests)], turn_rows)
        drawn = {
            name: [Row.of(g, spent=False) for gens in out for g in gens]
            for name, out in zip(controls, generated[len(requests) :], strict=True)
        }
        decode_seconds = time.perf_counter() - t0

        greedy = {ZERO_SHOT: turn.rows[ZERO_SHOT], first: turn.rows[STREAM]}
        turn_samples = first if turn.samples_under_memory else ZERO_SHOT
        sample_rows = {turn_samples: turn.samples, other_samples: drawn[f"samples[{other_samples}]"]}
        for obj in arms:
            if obj != first:
                greedy[obj], sample_rows[obj] = drawn[f"greedy[{obj}]"][0], drawn[f"samples[{obj}]"]
        answers = {n: r.answer for n, r in greedy.items()}
        sampled = {n: [r.answer for r in rs] for n, rs in sample_rows.items()}
        rows: dict[str, str | None] = {
            "zero_shot": answers[ZERO_SHOT],
            "self_consistency": plurality_vote(sampled[ZERO_SHOT], answers[ZERO_SHOT], with_greedy=True),
            "format": drawn["format"][0].answer,
            "init_greedy": turn.rows[INIT].answer if INIT in turn.rows else answers[ZERO_SHOT],
        }
        zero_shot_source = {obj: self._configs[obj].stream.tuning.learn_from == "zero_shot" for obj in arms}
        for obj in arms:
            rows[f"stream_greedy[{obj}]"] = answers[obj]
            rows[f"stream_vote[{obj}]"] = plurality_vote(sampled[obj], answers[obj], with_greedy=True)
            if zero_shot_source[obj]:  # what the graph answers then: its greedy answer among the zero-shot samples
                rows[f"stream_zs_vote[{obj}]"] = plurality_vote(sampled[ZERO_SHOT], answers[obj], with_greedy=True)
        tokens = {
            "zero_shot": greedy[ZERO_SHOT].tokens,
            "self_consistency": greedy[ZERO_SHOT].tokens + sum(r.tokens for r in sample_rows[ZERO_SHOT]),
            "elm_stream": turn.tokens,
            **{f"stream_greedy[{obj}]": greedy[obj].tokens for obj in arms},
        }

        def learned_from(source: str) -> list[Generated]:
            return [Generated(greedy[source].token_ids, answers[source], False)] + [
                Generated(r.token_ids, r.answer, True) for r in sample_rows[source]
            ]

        # the other arms learn by the graph's rule too: from their own rows and vote, or from zero-shot's rows and
        # self-consistency's vote while the guard watches their greedy answer alone
        others = [obj for obj in arms if obj != first]
        self._pending = {
            "question": question,
            "prompt": prompt,
            "turn": turn,
            "generations": {obj: learned_from(ZERO_SHOT if zero_shot_source[obj] else obj) for obj in others},
            "labels": {
                obj: rows["self_consistency" if zero_shot_source[obj] else f"stream_vote[{obj}]"] for obj in others
            },
            "served": {
                obj: [answers[obj]] if zero_shot_source[obj] else [answers[obj], *sampled[obj]] for obj in others
            },
            "versions": versions,
            "zero_shot": answers[ZERO_SHOT],
        }
        candidates = [
            {"kind": "zero_shot", "answer": answers[ZERO_SHOT], "score": None},
            {"kind": "memory", "answer": answers[first], "score": None},
        ]
        return MethodOutput(
            answer=turn.answer,
            response=turn.response,
            route="vote",
            candidates=candidates,
            extra={
                "stream": {
                    "rows": rows,
                    "samples": sampled,
                    "tokens": tokens,
                    "versions": versions,
                    "kind": lead.kind,
                    "init_is_zero_shot": INIT not in turn.rows,
                    "decode_rows": sum(len(r[0]) for r in all_requests),
                    "decode_seconds": round(decode_seconds, 3),
                }
            },
        )

    # -- learning ----------------------------------------------------------------------
    def learn(self, question: str, question_id: str, output: MethodOutput) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending["question"] != question:
            raise RuntimeError(f"{self.name}: learn() must follow answer() on the same question")
        prompt, first = pending["prompt"], self.objectives[0]
        lead_update = pending["turn"].learn(self._configs[first], self.arms[first], prompt)
        updates = {first: lead_update.to_dict()}
        for obj, arm in self.arms.items():
            if obj == first:
                continue
            update = arm.learn(
                question,
                prompt.token_ids,
                prompt.memory_at,
                pending["generations"][obj],
                label=pending["labels"][obj],
                version_used=pending["versions"][obj],
                zero_shot_answer=pending["zero_shot"],
                served_answers=pending["served"][obj],
            )
            updates[obj] = update.to_dict()
        extra = output.extra.setdefault("stream", {})
        extra["updates"] = updates
        extra["pending_states"] = {obj: arm.pending_state() for obj, arm in self.arms.items()}  # resume puts back
        extra["label_sources"] = {spec.name: spec.label for spec in self.specs}

    def resume(self, records: list[dict[str, Any]]) -> None:
        """A resumed run: each arm serves the version its last record ended with (an update written after the last
        record, the process stopped between the two, is undone by a new version holding the recorded one), with
        the guard's readings and the pooled questions as that record saw them."""
        if not records:
            return
        last = max(records, key=lambda r: r["index"])
        recorded_extra = (last.get("extra") or {}).get("stream") or {}
        updates = recorded_extra.get("updates") or {}
        pending_states = recorded_extra.get("pending_states") or {}
        for obj, arm in self.arms.items():
            recorded = (updates.get(obj) or {}).get("version")
            newest = arm.history[-1] if arm.history else {}
            # newest rollback_to == recorded: an earlier resume already serves a copy of it (its moments pruned there)
            if recorded is not None and recorded != arm.version and newest.get("rollback_to") != recorded:
                arm.restore_version(int(recorded), reason="resume: the update after the last record was not recorded")
            if obj in pending_states:
                arm.restore_pending(pending_states[obj])

    def pool_stats(self) -> tuple[int, int]:
        from elm_memory.eval.methods.base import dir_bytes

        root = self.runtime.out_dir / STREAM_DIR
        return (len(self._arms) if self._arms else 0), dir_bytes(root)

    def close(self) -> None:
        if self._arms:
            for obj, arm in self._arms.items():
                arm.write_summary(self.runtime.out_dir / STREAM_DIR / obj / "summary.json")


def elm_stream(runtime: EvalRuntime) -> StreamEval:
    return StreamEval(runtime)


def elm_stream_objectives(runtime: EvalRuntime) -> StreamEval:
    return StreamEval(runtime, ["grpo", "sft"], name="elm_stream_objectives")


def elm_stream_sources(runtime: EvalRuntime) -> StreamEval:
    """Two ``sft`` arms on the same questions: ``sft`` learns from its own votes, ``sft_zs`` from zero-shot's rows
    and self-consistency's vote (the ablation of the label source)."""
    own, zero_shot = (("learn_from", "own"),), (("learn_from", "zero_shot"),)
    arms = [Arm("sft", "sft", settings=own), Arm("sft_zs", "sft", settings=zero_shot)]
    return StreamEval(runtime, name="elm_stream_sources", arms=arms)


def elm_stream_gold(runtime: EvalRuntime) -> StreamEval:
    arms = [Arm("grpo", "grpo"), Arm("grpo_gold", "grpo", label="gold")]
    return StreamEval(runtime, name="elm_stream_gold", arms=arms)


def zero_shot_format(runtime: EvalRuntime) -> ZeroShotFormat:
    return ZeroShotFormat(runtime)
