"""The method's hyperparameters: prompt, answer decoding, memory shape, training, retrieval, verifier.

Each default is the value published in the ELM paper (Qwen2.5-Math-7B setting) where it gives one,
and the field's description says "paper: ..."; the other defaults are this library's, and the
description says why (or whose default it is, e.g. TRL's), as TRL's ``GRPOConfig`` documents its
fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from elm_memory.config.section import ConfigSection, registered_name

#: The paper's zero-shot chain-of-thought prompt (Appendix "Prompts").
#: ``{question}`` is substituted literally (not str.format), so LaTeX braces need no escaping.
PAPER_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}.\n{question}"


class PromptConfig(ConfigSection):
    """How a question becomes model input, and where a memory (soft prompt) sits in it."""

    template: str = Field(
        default=PAPER_PROMPT,
        description=(
            "User message; `{question}` is replaced by the question. Default: the paper's zero-shot chain-of-thought "
            'prompt (paper, appendix "Prompts").'
        ),
    )
    use_chat_template: bool | None = Field(
        default=None,
        description=(
            "Wrap in the tokenizer's chat template. None: when the tokenizer has one (paper: only for the "
            "Llama-3.1-8B-Instruct model; the Qwen2.5-Math-7B base model gets the plain prompt, preset `paper`)."
        ),
    )
    system_prompt: str | None = Field(
        default=None, description="System message for chat models; None keeps the template's own default."
    )
    soft_prompt_position: Literal["prefix", "user_turn"] = Field(
        default="prefix",
        description=(
            "`prefix`: memory vectors before every token, as in the paper ([m, x]). "
            "`user_turn`: right after the chat template's user header, so the template stays intact."
        ),
    )

    @field_validator("template")
    @classmethod
    def _has_question(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("prompt.template must contain '{question}'")
        return v


class GenerationConfig(ConfigSection):
    """Answer-time decoding (the zero-shot and the memory-conditioned answers)."""

    max_new_tokens: int = Field(default=2048, ge=1, description="Longest answer, in tokens (paper: 2048).")
    temperature: float = Field(
        default=0.0, ge=0.0, description="0 means greedy decoding, as in the paper (greedy pass@1)."
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus mass when `temperature` > 0; 1.0 = off (the paper decodes greedily, so it sets none).",
    )
    stop_at_answer: bool = Field(
        default=False, description="Stop once a final \\boxed{} is closed (saves time; the paper does not stop early)."
    )


class MemoryConfig(ConfigSection):
    """Parameterisation, shape and initialisation of a latent memory (paper: a soft prompt)."""

    kind: Literal["soft_prompt", "lora", "prefix"] = Field(
        default="soft_prompt",
        description=(
            "What a memory is (paper, ablation 'Memory Design'): `soft_prompt` (the paper's choice: k input "
            "vectors, ~0.001% of the model), `lora` (the paper's LoRA ablation: rank 16 on q,k,v,o,gate,up,down, "
            "lr 1e-4; 40-42M parameters on the 7-8B models, 8.8M on the default 0.5B) or `prefix` (prefix tuning, "
            "paper appendix: per-layer key/value prefix of k positions initialised from the question's key/value "
            "activations, lr 1e-3). The paper found soft prompts better and lighter than both. `lora` and `prefix` "
            "train with the native engine and serve from the `hf` backend (`lora` also from vLLM). "
            "See docs/memory-kinds.md."
        ),
    )
    num_tokens: int = Field(
        default=20,
        ge=1,
        description="k: soft-prompt vectors per memory, or prefix positions per layer for `prefix` (paper: 20).",
    )
    init: Literal["question", "random"] = Field(
        default="question",
        description=(
            "`question`: the question's own token embeddings (paper). Shorter questions are tiled "
            "(repeated from the start), longer ones truncated to the first k tokens. (`prefix` always starts from "
            "the question's key/values, `lora` from B = 0.)"
        ),
    )
    lora_rank: int = Field(default=16, ge=1, description="`lora`: rank r (paper: 16).")
    lora_alpha: float = Field(
        default=32.0,
        gt=0.0,
        description="`lora`: scale alpha (delta = alpha/r * B A x); the paper names none, 2r is the common choice.",
    )
    learning_rate: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "AdamW learning rate for this kind; None: the paper's, i.e. `training.learning_rate` (1e-4) for "
            "`soft_prompt` and `lora`, 1e-3 for `prefix`."
        ),
    )

    def effective_learning_rate(self, training_rate: float) -> float:
        """The learning rate a memory of this kind trains with (None resolved to the paper's value)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-3 if self.kind == "prefix" else training_rate


class TrainingConfig(ConfigSection):
    """Memory creation: GRPO on the soft prompt with TTRL majority-vote rewards."""

    engine: str = Field(
        default="native",
        description=(
            "`native`: this library's loop (several memories train as one batch); `trl`: TRL's GRPOTrainer + "
            "PEFT prompt tuning, the paper's implementation (same loss and hyperparameters); "
            "or a plugin engine registered under `elm_memory.training_engines`. See docs/configuration.md."
        ),
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        return registered_name("training_engines", v)

    objective: Literal["grpo", "sft"] = Field(
        default="grpo", description="`grpo` (paper) or `sft` on the greedy answer (paper's ELM-SFT ablation)."
    )
    steps: int = Field(default=10, ge=0, description="S: gradient steps per memory (paper: 10; ablation: 2).")
    num_generations: int = Field(default=8, ge=1, description="G: rollouts per step (paper: 8).")
    learning_rate: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate, constant (paper: 1e-4).")
    beta: float = Field(default=0.01, ge=0.0, description="KL coefficient to the reference policy (paper: 0.01).")
    loss_type: Literal["dr_grpo", "grpo", "bnpo"] = Field(
        default="dr_grpo", description="`dr_grpo` (paper): token-sum / max_completion_length, no std scaling."
    )
    reference_policy: Literal["initial_prompt", "base_model"] = Field(
        default="initial_prompt",
        description=(
            "KL reference: the frozen model with the memory's *initial* soft prompt (default), or the bare base "
            "model (what TRL + PEFT prompt tuning, the paper's implementation, uses, since it disables the "
            "adapter for the reference)."
        ),
    )
    scale_rewards: bool = Field(
        default=False,
        description="Divide advantages by the group std (off: Dr.GRPO, the paper's loss, does not scale).",
    )
    temperature: float | None = Field(
        default=None,
        ge=0.0,
        description="Rollout temperature. None: the paper's value for the model family (0.7 Llama, 0.8 others).",
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Rollout nucleus mass; 1.0 = off (TRL's default; the paper names no other).",
    )
    max_completion_length: int = Field(default=2048, ge=1, description="Rollout length cap in tokens (paper: 2048).")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay (TRL default 0).")
    max_grad_norm: float | None = Field(default=1.0, description="Gradient clipping (TRL default 1.0); None disables.")
    stop_at_answer: bool = Field(
        default=False, description="Speed lever: end a rollout once its final \\boxed{} is closed. Off = faithful."
    )
    skip_uniform_rewards: bool = Field(
        default=True, description="Skip the backward when all rewards in the group are equal (zero advantage)."
    )
    skip_below_majority_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Skip a step's update (as for uniform rewards) when the share of its rollouts that gave the majority "
            "answer is below this: with four different answers in four rollouts the majority reward is noise. "
            "0.0 = off (paper). Native engine only."
        ),
    )
    share_prompt_kv: bool = Field(
        default=True,
        description=(
            "Speed lever: score a memory's G rollouts against one forward of its prompt (KV cache repeated per "
            "rollout) instead of G copies of the prompt; same loss up to float rounding."
        ),
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Rollouts per forward/backward (gradient accumulation inside a step), counted across the memories "
            "trained together. None: one on a CPU, G (one memory's group) on a GPU (why: docs/performance.md)."
        ),
    )
    seed: int | None = Field(default=42, description="Seed for rollouts and init; None for nondeterministic.")

    def effective_temperature(self, model_type: str | None) -> float:
        """The rollout temperature, resolving None to the paper's per-family value."""
        if self.temperature is not None:
            return self.temperature
        return 0.7 if model_type and "llama" in model_type.lower() else 0.8


class RetrievalConfig(ConfigSection):
    """How a stored memory is found for a new question."""

    key: str = Field(
        default="input",
        description=(
            "Key builder: `input` (mean input embedding; paper's default), `soft_prompt_mean`, `kv` "
            "(per-layer Q/K, the paper's variant that wins on some benchmarks), or `kv_centered` (`kv` with "
            "each side's mean direction over 64 MATH500 questions removed per layer; not in the paper, tells "
            "questions apart better on the default model). See docs/results/synth60-self-certainty.md."
        ),
    )
    top_k: int = Field(default=1, ge=1, description="Memories retrieved per question (paper: top-1).")
    min_similarity: float | None = Field(
        default=None,
        description="Ignore memories whose cosine similarity is below this; None keeps the top-1 (paper: none).",
    )
    skip_no_consensus: bool = Field(default=True, description="Never retrieve memories whose rollouts found no answer.")
    min_majority_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Never retrieve memories whose training vote was weak: the share of the last GRPO step's rollouts "
            "that gave the majority answer (`stats.majority_share`) is below this. Default 0.0 = off, as in the "
            "paper, which uses every memory. 0.5 keeps only memories learned from a strict majority: a weak vote "
            "means the rewards mostly taught agreement with a near-random answer. See docs/configuration.md."
        ),
    )
    min_utility: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description=(
            "Never retrieve memories whose measured utility is below this: (won + agreed) / (won + agreed + lost), "
            "counted on the answer path (`elm memories stats`), once a memory has `min_utility_observations` of "
            "them. Default None = off, as in the paper. A memory below 0.5 lost more verifier decisions than it "
            "won or agreed on; the gate's decision is `low_utility`. See docs/using.md."
        ),
    )
    min_utility_observations: int = Field(
        default=5,
        ge=1,
        description=(
            "Judged answers (won + agreed + lost) a memory needs before `min_utility` applies. Default 5: with "
            "fewer, one unlucky verifier call would decide; a new memory is always tried first."
        ),
    )


class VerifierConfig(ConfigSection):
    """Scorer that routes between the zero-shot and the memory answer when they disagree."""

    name: str = Field(
        default="prm",
        description="`prm` (paper), `self_certainty` (cpu-tiny), `logprob`, `consistency` (cpu-demo), or a plugin.",
    )
    prefer_answered: bool = Field(
        default=False,
        description=(
            "When only one of the two candidates reached a final \\boxed{} answer, it wins without scoring "
            "(route `answered`): an answer-less response cannot be graded right, and cheap scorers such as "
            "self-certainty can rate its rambling highly. Off by default: the paper always asks the verifier."
        ),
    )
    route: Literal["verify", "vote"] = Field(
        default="verify",
        description=(
            "How the answer is chosen once a memory answered. `verify` (paper): agreeing answers win, otherwise "
            "the verifier scores both. `vote`: the answer is the majority of the zero-shot answer, the "
            "`consistency` verifier's samples (drawn on every question) and the memory's answer, ties to "
            "zero-shot: self-consistency with the memory as one more vote, so ELM spends the same samples as the "
            "`self_consistency` baseline and can only differ from it by the memory's vote. Needs `consistency`."
        ),
    )
    model: str = Field(
        default="Qwen/Qwen2.5-Math-PRM-7B",
        description="PRM model id or path, for `prm` (paper: Qwen/Qwen2.5-Math-PRM-7B).",
    )
    aggregate: Literal["min", "last", "product", "mean"] = Field(
        default="min", description="PRM step-score aggregation."
    )
    trust_remote_code: bool | None = Field(
        default=None, description="Run the PRM's own modelling code. None: only for the official Qwen2.5-Math-PRM ids."
    )
    conditioning: Literal["plain", "own"] = Field(
        default="plain",
        description=(
            "Policy-model verifiers score both answers under the same plain prompt (`plain`, comparable scores) "
            "or each under the prompt it was generated from, memory included (`own`)."
        ),
    )
    consistency_samples: int = Field(
        default=4,
        ge=1,
        description=(
            "`consistency`: zero-shot samples drawn per disagreement (one batched call); each answer scores the "
            "fraction of samples that agree with it. Default 4: half a training step's G=8 rollouts, so routing "
            "costs less than learning, yet no single stray sample decides."
        ),
    )
    consistency_max_new_tokens: int = Field(
        default=512,
        ge=1,
        description=(
            "`consistency`: longest sample, in tokens. Samples stop at their first closed \\boxed{} and a "
            "sample cut off before one counts for no answer; 512 covers typical GSM8K/MATH solutions at a "
            "quarter of the 2048-token answer budget."
        ),
    )
    consistency_presample: bool = Field(
        default=True,
        description=(
            "`consistency`: draw the samples in the same decode batch as the two answers whenever a memory was "
            "retrieved, instead of in a call of their own after a disagreement. On a backend that batches calls "
            "(`hf`) extra rows cost little per decode step, so a disagreement needs no decode of its own; the "
            "rows are wasted when the answers agree. Drawn ahead, a sample is cut at the answers' budget "
            "(`generation.max_new_tokens`, if shorter). Backends that do not batch calls (vLLM) sample after "
            "a disagreement either way. Measured cost: docs/results/synth60-self-certainty.md."
        ),
    )
    consistency_tie_samples: int = Field(
        default=0,
        ge=0,
        description=(
            "`consistency`: when both answers score the same (a tie keeps zero-shot whatever the memory answered), "
            "draw this many more samples in one call (seed + 1, up to `consistency_max_new_tokens`) and score on "
            "all of them (adaptive consistency); 0: off. Only ties pay for it: one sampling call each. Not "
            "recommended: it helped on the runs it was designed on and not on held-out seeds "
            "(docs/results/synth60-consistency.md)."
        ),
    )
    consistency_temperature: float = Field(
        default=0.7,
        gt=0.0,
        description=(
            "`consistency`: sampling temperature (> 0: greedy samples would all be one answer). 0.7 is a common "
            "self-consistency setting: diverse enough to disagree, rarely incoherent."
        ),
    )
