"""Memory creation: rewards, losses, init, the native loop on real weights, the TRL engine."""

from __future__ import annotations

import pytest
import torch
from _fakes import ScriptedRollouts, weights_checksum

from elm_memory.backends.base import PromptInput
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig, TrainingConfig
from elm_memory.errors import IncompatibleMemoryError, MemoryFormatError, NonFiniteError
from elm_memory.memory import LatentMemory
from elm_memory.memory.init import init_soft_prompt, tile_to_length
from elm_memory.training.learn import learn_memory
from elm_memory.training.losses import advantages_from_rewards, policy_loss
from elm_memory.training.native import NativeTrainer
from elm_memory.training.rewards import majority_vote_rewards

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"


# -- pure pieces ---------------------------------------------------------------------


def test_majority_vote_reward_on_hand_written_completions():
    group = majority_vote_rewards(
        [
            "3 + 4 = 7, so \\boxed{7}.",
            "He has \\boxed{7} apples.",
            "I think \\boxed{12}",
            "no final answer here",
            "That is \\boxed{7.0}",
            "\\boxed{\\frac{14}{2}}",
        ]
    )
    assert group.answers == ["7", "7", "12", None, "7.0", "\\frac{14}{2}"]
    assert group.vote.answer == "7" and group.vote.count == 4 and group.vote.total == 6
    assert group.rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert not group.uniform
    assert majority_vote_rewards(["none", "none either"]).rewards == [0.0, 0.0]
    assert majority_vote_rewards(["none", "none either"]).uniform


def test_dr_grpo_loss_matches_a_hand_computation():
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = advantages_from_rewards(torch.tensor([1.0, 0.0]), scale=False)
    assert adv.tolist() == [0.5, -0.5]
    loss, kl = policy_loss(logps, logps.detach(), adv, mask, beta=0.01, loss_type="dr_grpo", max_completion_length=4)
    # ratio = 1 and KL = 0 in value: loss = -(0.5*2 - 0.5*1) / (2 rows * 4 max tokens)
    assert loss.item() == pytest.approx(-(0.5 * 2 - 0.5 * 1) / 8)
    assert kl.item() == 0.0
    loss.backward()
    # d loss / d logp = -adv / (G * L) on real tokens, 0 on padding
    expected = torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]) / 8
    assert torch.allclose(logps.grad, expected)


def test_kl_term_and_micro_batches_sum_to_the_group_loss():
    torch.manual_seed(0)
    logps = -torch.rand(4, 5)
    ref = -torch.rand(4, 5)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    adv = torch.tensor([0.75, -0.25, -0.25, -0.25])
    for loss_type in ("dr_grpo", "grpo", "bnpo"):
        kwargs = dict(
            beta=0.01, loss_type=loss_type, max_completion_length=8, group_size=4, group_tokens=int(mask.sum())
        )
        whole, kl = policy_loss(logps, ref, adv, mask, **kwargs)
        parts = sum(
            policy_loss(logps[i : i + 2], ref[i : i + 2], adv[i : i + 2], mask[i : i + 2], **kwargs)[0] for i in (0, 2)
        )
        assert torch.allclose(whole, parts), loss_type
    delta = ref - logps
    expected_kl = ((torch.exp(delta) - delta - 1) * mask).sum() / mask.sum()
    assert torch.allclose(kl, expected_kl) and kl.item() > 0


def test_init_tiles_or_truncates_the_question_tokens():
    assert tile_to_length([5, 6, 7], 7) == [5, 6, 7, 5, 6, 7, 5]
    assert tile_to_length(list(range(30)), 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        tile_to_length([], 3)
    emb = torch.nn.Embedding(10, 4)
    out = init_soft_prompt(emb, [3, 1], 5)
    assert torch.equal(out, emb.weight[[3, 1, 3, 1, 3]].detach())
    assert out.dtype == torch.float32 and not out.requires_grad


# -- the native loop on real weights -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup(tiny_loaded, tiny_backend):
    cfg = ELMConfig.load(preset="cpu-tiny", overrides={"training": {"steps": 3, "num_generations": 4}})
    return cfg, PromptBuilder(tiny_loaded.tokenizer, cfg.prompt, tiny_loaded.info.max_context)


@pytest.mark.model
def test_grpo_moves_the_soft_prompt_and_never_the_model(tiny_loaded, tiny_backend, tiny_setup):
    cfg, prompts = tiny_setup
    scripted = ScriptedRollouts(tiny_backend, ["so \\boxed{7}", "\\boxed{7} apples", "maybe \\boxed{8}", "\\boxed{7}"])
    before = weights_checksum(tiny_loaded.model)
    trainer = NativeTrainer(tiny_loaded, scripted, cfg.training)
    memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=scripted, prompts=prompts, trainer=trainer)
    s = memory.meta.stats
    assert s.mean_reward == [0.75, 0.75, 0.75] and s.majority_answer == "7" and s.majority_share == 0.75
    assert s.skipped_backward == [False, False, False] and not s.no_consensus
    assert s.kl[0] == 0.0 and s.kl[-1] > 0.0  # policy drifts from the reference after the first update
    q_ids = tiny_loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    init = init_soft_prompt(tiny_loaded.model.get_input_embeddings(), q_ids, 20)
    assert memory.soft_prompt.shape == (20, tiny_loaded.info.hidden_size)
    assert not torch.equal(memory.soft_prompt, init)  # the memory learned something
    assert (memory.soft_prompt - init).abs().max() < 1e-2  # ...with lr 1e-4 over 3 steps: a small move
    assert weights_checksum(tiny_loaded.model) == before  # the base model is frozen
    assert all(not p.requires_grad for p in tiny_loaded.model.parameters())
    # Rollouts were drawn with the current soft prompt, in the configured position, each step.
    assert len(scripted.calls) == 3 and all(c.soft_prompt is not None for c in scripted.calls)
    assert torch.equal(scripted.calls[0].soft_prompt, init)
    assert not torch.equal(scripted.calls[2].soft_prompt, init)


@pytest.mark.model
def test_uniform_rewards_skip_the_backward(tiny_loaded, tiny_backend, tiny_setup):
    cfg, prompts = tiny_setup
    scripted = ScriptedRollouts(tiny_backend, ["\\boxed{7}"])
    memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=scripted, prompts=prompts)
    s = memory.meta.stats
    assert s.skipped_backward == [True, True, True] and s.mean_reward == [1.0, 1.0, 1.0]
    q_ids = tiny_loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    assert torch.equal(memory.soft_prompt, init_soft_prompt(tiny_loaded.model.get_input_embeddings(), q_ids, 20))


@pytest.mark.model
def test_reference_logprobs_are_the_initial_policys(tiny_loaded, tiny_backend, tiny_setup):
    cfg, prompts = tiny_setup
    built = prompts.build(QUESTION)
    q_ids = tiny_loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    init = init_soft_prompt(tiny_loaded.model.get_input_embeddings(), q_ids, 20)
    completions = [tiny_loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["\\boxed{7}", "It is 8"]]
    trainer = NativeTrainer(tiny_loaded, tiny_backend, cfg.training)
    T = trainer.temperature

    def independent(soft: torch.Tensor) -> list[torch.Tensor]:
        """log-softmax(logits / T) of each completion, one sequence at a time, no padding."""
        from elm_memory.backends.base import compose_embeddings

        out = []
        for comp in completions:
            p = PromptInput(tuple(built.token_ids) + tuple(comp), soft_prompt=soft, soft_prompt_at=0)
            emb = compose_embeddings(p, tiny_backend.embed_tokens).unsqueeze(0)
            with torch.no_grad():
                logits = tiny_loaded.model(inputs_embeds=emb).logits[0].float() / T
            n = len(comp)
            lp = torch.log_softmax(logits[-n - 1 : -1], -1).gather(1, torch.tensor(comp)[:, None]).squeeze(1)
            out.append(lp)
        return out

    ref = trainer.reference_logps(built.token_ids, init, 0, completions)
    for row, expected in zip(ref, independent(init), strict=True):
        assert torch.allclose(row[: len(expected)], expected, atol=1e-4)
    moved = init + 0.05 * torch.randn_like(init)
    ref_after = trainer.reference_logps(built.token_ids, init, 0, completions)  # still the initial policy
    current, _ = trainer.completion_logps(built.token_ids, moved, 0, completions)
    assert torch.allclose(ref_after, ref)
    assert not torch.allclose(current.detach()[0, :3], ref[0, :3], atol=1e-4)
    base_cfg = cfg.training.model_copy(update={"reference_policy": "base_model"})
    base_ref = NativeTrainer(tiny_loaded, tiny_backend, base_cfg).reference_logps(built.token_ids, init, 0, completions)
    for row, expected in zip(base_ref, independent(init[:0]), strict=True):
        assert torch.allclose(row[: len(expected)], expected, atol=1e-4)


@pytest.mark.model
def test_real_rollouts_without_answers_flag_no_consensus(tiny_loaded, tiny_backend, tiny_setup):
    cfg, prompts = tiny_setup
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 1, "num_generations": 2})})
    memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=tiny_backend, prompts=prompts)
    s = memory.meta.stats
    assert s.no_consensus and s.majority_answer is None and s.answers == [[None, None]]
    assert s.completion_tokens > 0 and s.generation_seconds > 0


@pytest.mark.model
def test_sft_objective_runs_in_the_same_loop(tiny_loaded, tiny_backend, tiny_setup):
    cfg, prompts = tiny_setup
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"objective": "sft", "steps": 2})})
    memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=tiny_backend, prompts=prompts)
    s = memory.meta.stats
    assert s.objective == "sft" and s.steps == 2 and len(s.loss) == 2 and s.loss[0] > 0
    assert s.loss[1] < s.loss[0]  # NLL of the greedy answer goes down


@pytest.mark.model
def test_nan_aborts_the_memory(tiny_loaded, tiny_backend, tiny_setup, monkeypatch):
    cfg, prompts = tiny_setup
    scripted = ScriptedRollouts(tiny_backend, ["\\boxed{7}", "\\boxed{8}"])
    trainer = NativeTrainer(tiny_loaded, scripted, cfg.training)
    real = trainer.completion_logps

    def poisoned(*args, **kwargs):
        logps, mask = real(*args, **kwargs)
        return logps * float("nan"), mask

    monkeypatch.setattr(trainer, "completion_logps", poisoned)
    with pytest.raises(NonFiniteError, match="aborted"):
        learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=scripted, prompts=prompts, trainer=trainer)


# -- the memory file ----------------------------------------------------------------------


def _memory(info, hidden=None, k=20):
    from dataclasses import replace

    info = replace(info, hidden_size=hidden or info.hidden_size)
    return LatentMemory.create(torch.randn(k, info.hidden_size), question="q?", namespace="ns", model=info)


@pytest.mark.model
def test_saved_memory_reloads_bit_identical(tiny_loaded, tmp_path):
    mem = _memory(tiny_loaded.info)
    mem.keys["input"] = torch.randn(tiny_loaded.info.hidden_size)
    mem.meta.stats.mean_reward = [0.5, 0.75]
    path = mem.save(tmp_path / "m.safetensors")
    again = LatentMemory.load(path)
    assert torch.equal(again.soft_prompt, mem.soft_prompt) and torch.equal(again.keys["input"], mem.keys["input"])
    assert again.meta == mem.meta
    assert LatentMemory.from_bytes(mem.to_bytes()).meta == mem.meta
    assert path.read_bytes()[:8] != b"\x80\x04\x95"  # not a pickle
    again.check_compatible(tiny_loaded.info)


@pytest.mark.model
def test_bad_memory_files_are_refused(tiny_loaded, tmp_path):
    with pytest.raises(MemoryFormatError):
        LatentMemory.from_bytes(b"definitely not safetensors")
    with pytest.raises(MemoryFormatError, match="cannot read"):
        LatentMemory.load(tmp_path / "missing.safetensors")
    other = _memory(tiny_loaded.info, hidden=896)
    with pytest.raises(IncompatibleMemoryError, match="hidden size 896"):
        other.check_compatible(tiny_loaded.info)
    with pytest.raises(MemoryFormatError, match="NaN"):
        LatentMemory.create(torch.full((20, 576), float("nan")), question="q", namespace="n", model=tiny_loaded.info)
    from safetensors.torch import save

    bad = save({"soft_prompt": torch.zeros(20, 576)})  # no metadata
    with pytest.raises(MemoryFormatError, match="metadata"):
        LatentMemory.from_bytes(bad)


# -- the TRL engine -----------------------------------------------------------------------


@pytest.mark.model
def test_trl_engine_runs_one_step_and_leaves_the_model_untouched(tiny_loaded, tiny_backend, tiny_setup):
    pytest.importorskip("trl")  # the 'trl' extra; installed by the test command
    cfg, prompts = tiny_setup
    training = cfg.training.model_copy(
        update={"engine": "trl", "steps": 1, "num_generations": 2, "max_completion_length": 8}
    )
    cfg = cfg.model_copy(update={"training": training})
    before = weights_checksum(tiny_loaded.model)
    memory = learn_memory(QUESTION, config=cfg, loaded=tiny_loaded, backend=tiny_backend, prompts=prompts)
    assert memory.meta.stats.engine == "trl" and memory.meta.stats.steps == 1
    assert memory.soft_prompt.shape == (20, tiny_loaded.info.hidden_size)
    assert len(memory.meta.stats.answers) == 1 and len(memory.meta.stats.answers[0]) == 2
    assert weights_checksum(tiny_loaded.model) == before
    assert type(tiny_loaded.model).__name__ == "LlamaForCausalLM" and not tiny_loaded.model.training
    # same format as native memories
    assert LatentMemory.from_bytes(memory.to_bytes()).meta.stats.engine == "trl"


def test_trl_engine_refuses_what_peft_cannot_do(tiny_loaded):
    from elm_memory.errors import ConfigError
    from elm_memory.training.trl_engine import TRLTrainer

    trainer = TRLTrainer(tiny_loaded, TrainingConfig(steps=1))
    with pytest.raises(ConfigError, match="prefix"):
        trainer.train([1, 2, 3], torch.zeros(20, 576), at=2)
    with pytest.raises(ConfigError, match="native"):
        trainer.train([1, 2, 3], torch.zeros(20, 576), objective="sft")
