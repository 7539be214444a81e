"""``prm``: a process reward model in the Qwen2.5-Math-PRM style (the paper's verifier).

As on the model card of ``Qwen/Qwen2.5-Math-PRM-7B``:

1. the response is split into steps on blank lines (``\\n\\n``; runs of blank lines and
   whitespace-only lines count as one break; empty steps are dropped);
2. the steps are joined with the step token ``<extra_0>`` and one more ``<extra_0>`` is
   appended, so every step is followed by exactly one step token;
3. the chat template is applied to ``[system: QWEN_PRM_SYSTEM_PROMPT, user: question,
   assistant: joined steps]`` (no generation prompt);
4. one forward gives 2-class logits per token; the reward of step i is
   ``softmax(logits)[..., 1]`` (the positive class) at the i-th step-token position;
5. the response score aggregates the step rewards (``verifier.aggregate``): ``min``
   (default: a chain is as good as its worst step), ``last``, ``product`` or ``mean``.

The real PRM is remote code (``Qwen2ForProcessRewardModel``: Qwen2 decoder + 2-class
MLP head, loaded with ``AutoModel`` and ``trust_remote_code``). Everything except the
loader works on any model returning ``(1, T, 2)`` logits, e.g. a transformers
``Qwen2ForTokenClassification(num_labels=2)``, which is what the tests use.

Edge cases: an empty (or whitespace-only) response has no steps and scores
:data:`~elm_memory.verifiers.base.EMPTY_SCORE` without running the model. The literal
step token inside a response is removed (it would fake a step boundary). Inputs longer
than the PRM's context (``max_position_embeddings``) are cut at the end: the steps whose
step token still fits are scored (a causal PRM scores them exactly as it would in the full
input), so ``last`` then means the last step that fits; if none fits the score is
``EMPTY_SCORE``. The model is loaded lazily on the first non-empty ``score`` call, kept in
eval mode, and run under ``torch.no_grad()``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from elm_memory.errors import ConfigError, ModelNotFoundError
from elm_memory.hardware import resolve_placement
from elm_memory.verifiers.base import EMPTY_SCORE, Candidate, eval_mode

if TYPE_CHECKING:
    import torch

    from elm_memory.config import ELMConfig

log = logging.getLogger(__name__)

QWEN_PRM_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
STEP_TOKEN = "<extra_0>"
#: Hub ids whose remote code is trusted by default (the official Qwen PRMs). Anything else
#: needs ``trust_remote_code=True`` explicitly when it ships its own modelling code.
TRUSTED_REMOTE_CODE = frozenset({"Qwen/Qwen2.5-Math-PRM-7B", "Qwen/Qwen2.5-Math-PRM-72B"})

Aggregate = Literal["min", "last", "product", "mean"]
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


# ---- pure pieces (tested without a real PRM) -----------------------------------------


def split_steps(text: str, *, step_token: str = STEP_TOKEN) -> list[str]:
    """Blank-line separated, stripped, non-empty steps (the step token itself removed)."""
    text = text.replace(step_token, "")
    return [s.strip() for s in _BLANK_LINE.split(text) if s.strip()]


def format_prm_text(
    tokenizer: Any,
    question: str,
    steps: Sequence[str],
    *,
    step_token: str = STEP_TOKEN,
    system_prompt: str = QWEN_PRM_SYSTEM_PROMPT,
) -> str:
    """The conversation the PRM reads, with one step token after every step."""
    assistant = step_token.join(steps) + step_token
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": question},
            {"role": "assistant", "content": assistant},
        ]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return f"{system_prompt}\n\n{question}\n\n{assistant}"


def step_rewards(logits: torch.Tensor, input_ids: Any, step_token_id: int) -> torch.Tensor:
    """Positive-class probability at each step-token position: (num_steps,) float32.

    ``logits``: (1, T, 2) or (T, 2) model outputs; ``input_ids``: the T token ids.
    """
    import torch

    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"step_rewards takes one sequence, got a batch of {logits.shape[0]}")
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[-1] != 2:
        raise ConfigError(
            f"a PRM must output 2-class logits per token, got shape {tuple(logits.shape)}; "
            "is verifier.model a process reward model?"
        )
    ids = torch.as_tensor(input_ids).reshape(-1).to(logits.device)
    if ids.numel() != logits.shape[0]:
        raise ValueError(f"{ids.numel()} token ids for {logits.shape[0]} logit rows")
    probs = torch.softmax(logits.float(), dim=-1)[:, 1]
    return probs[ids == step_token_id].cpu()


def aggregate_rewards(rewards: Sequence[float] | torch.Tensor, how: Aggregate = "min") -> float:
    """One score from per-step rewards; :data:`EMPTY_SCORE` when there are no steps."""
    values = [float(r) for r in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
    if not values:
        return EMPTY_SCORE
    if how == "min":
        return min(values)
    if how == "last":
        return values[-1]
    if how == "product":
        return math.prod(values)
    if how == "mean":
        return math.fsum(values) / len(values)
    raise ConfigError(f"unknown PRM aggregation {how!r}; available: min, last, product, mean")


def load_prm(
    name_or_path: str, *, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """(model, tokenizer) of a PRM, frozen and in eval mode.

    Checkpoints declaring a ``*ForTokenClassification`` architecture load with
    ``AutoModelForTokenClassification``; others (the Qwen PRMs' remote
    ``Qwen2ForProcessRewardModel``) with ``AutoModel``, as their model card does.
    """
    import os

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification, AutoTokenizer

    local = Path(name_or_path).expanduser()
    path = str(local) if local.exists() else name_or_path
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        archs = getattr(config, "architectures", None) or []
        token_cls = any(a.endswith("ForTokenClassification") for a in archs)
        auto = AutoModelForTokenClassification if token_cls else AutoModel
        model = auto.from_pretrained(path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    except OSError as exc:
        hint = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise ModelNotFoundError(f"cannot load PRM {name_or_path!r}{hint}: {exc}".splitlines()[0]) from None
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ConfigError(
                f"PRM {name_or_path!r} ships its own modelling code; it runs only with trust_remote_code=True "
                "(trusted by default for the official Qwen PRMs only)"
            ) from None
        raise
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


# ---- the verifier --------------------------------------------------------------------


class PRMVerifier:
    """Scores responses with a process reward model it loads itself (lazily)."""

    name = "prm"

    def __init__(
        self,
        model_name: str = "Qwen/Qwen2.5-Math-PRM-7B",
        *,
        aggregate: Aggregate = "min",
        device: str = "auto",
        dtype: str = "bfloat16",
        trust_remote_code: bool | None = None,
        model: Any = None,
        tokenizer: Any = None,
        step_token: str = STEP_TOKEN,
        system_prompt: str = QWEN_PRM_SYSTEM_PROMPT,
        max_length: int | None = None,
    ):
        if aggregate not in ("min", "last", "product", "mean"):
            raise ConfigError(f"unknown PRM aggregation {aggregate!r}; available: min, last, product, mean")
        self.model_name = model_name
        self.aggregate = aggregate
        self.device = device
        self.dtype = dtype
        self.trust_remote_code = model_name in TRUSTED_REMOTE_CODE if trust_remote_code is None else trust_remote_code
        self.step_token = step_token
        self.system_prompt = system_prompt
        self.max_length = max_length
        self._model = model
        self._tokenizer = tokenizer
        self._step_id: int | None = None

    @classmethod
    def from_config(cls, cfg: ELMConfig, backend: Any = None) -> PRMVerifier:
        """From ``cfg.verifier`` (model id, aggregation); device and dtype follow ``cfg.model``."""
        return cls(
            cfg.verifier.model,
            aggregate=cfg.verifier.aggregate,
            device=cfg.model.device,
            dtype=resolve_placement(cfg.model, warn=False).dtype,
            trust_remote_code=cfg.verifier.trust_remote_code,
        )

    # -- loading -------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._model is not None and self._step_id is not None

    def load(self) -> None:
        if self._model is None or self._tokenizer is None:
            from elm_memory.models.loading import pick_device

            self._model, self._tokenizer = load_prm(
                self.model_name,
                device=pick_device(self.device),
                dtype=self.dtype,
                trust_remote_code=self.trust_remote_code,
            )
        tok = self._tokenizer
        step_id = tok.convert_tokens_to_ids(self.step_token)
        enc = tok(self.step_token, add_special_tokens=False)["input_ids"]
        if step_id is None or step_id == tok.unk_token_id or list(enc) != [step_id]:
            raise ConfigError(f"the PRM tokenizer of {self.model_name!r} has no single step token {self.step_token!r}")
        self._step_id = int(step_id)

    # -- scoring -------------------------------------------------------------------
    def step_scores(self, question: str, response: str) -> list[float]:
        """Per-step rewards of one response (empty list: no steps, or none fits the context)."""
        import torch

        steps = split_steps(response, step_token=self.step_token)
        if not steps:
            return []
        if not self.loaded:
            self.load()
        model, tok, step_id = self._model, self._tokenizer, self._step_id
        assert step_id is not None  # set by load()
        text = format_prm_text(tok, question, steps, step_token=self.step_token, system_prompt=self.system_prompt)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        limit = self._max_length()
        if limit is not None and len(ids) > limit:
            log.warning(
                "prm: input of %d tokens exceeds the PRM context of %d; scoring the steps that fit", len(ids), limit
            )
            ids = ids[:limit]
        device = next(model.parameters()).device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.no_grad(), eval_mode(model):
            out = model(input_ids=input_ids)
            logits = out.logits if getattr(out, "logits", None) is not None else out[0]
            return step_rewards(logits, input_ids, step_id).tolist()

    def score(self, question: str, responses: Sequence[Candidate]) -> list[float]:
        return [aggregate_rewards(self.step_scores(question, c.text), self.aggregate) for c in responses]

    def _max_length(self) -> int | None:
        if self.max_length is not None:
            return self.max_length
        cfg = getattr(self._model, "config", None)
        n = getattr(cfg, "max_position_embeddings", None)
        if n:
            return int(n)
        n = getattr(self._tokenizer, "model_max_length", None)
        return int(n) if n and n < 10**7 else None
