"""Sharpening: an entropy penalty on what to write given that the line continues; the stop decision untouched."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.ppo_helpers import cfg, make_trainer
from tests.unit.test_hindsight import served
from training.policy import load_tokenizer
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.rollout import collate
from training.sharpen import Sharpen


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


@pytest.fixture(scope="module")
def sharpen(tok):
    return Sharpen(tok, "\n")


def test_the_entropy_is_taken_over_the_tokens_that_continue_the_line(tok, sharpen) -> None:
    V, stops = len(tok), sharpen.stop_ids
    logits = torch.zeros(1, 3, V)  # uniform everywhere
    logits[0, 1, stops] = 50.0  # position 1 all but surely stops: given that it continues, still uniform
    logits[0, 2, 7 if 7 not in stops else 8] = 50.0  # position 2 surely writes one token: entropy 0
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    per_position = [float(sharpen.entropy_sum(logits[:, j : j + 1], mask[:, j : j + 1])) for j in range(3)]
    uniform = math.log(V - len(stops))
    assert per_position[0] == pytest.approx(uniform, rel=1e-5) and per_position[1] == pytest.approx(uniform, rel=1e-5)
    assert per_position[2] == pytest.approx(0.0, abs=1e-4)
    assert float(sharpen.entropy_sum(logits, torch.tensor([[1.0, 0.0, 1.0]]))) == pytest.approx(uniform, rel=1e-5)
    # a position whose nucleus holds only stop tokens has nothing to sharpen: 0, not NaN, and no NaN gradient
    cut = torch.full((1, 1, V), float("-inf"))
    cut[0, 0, stops] = 0.0
    cut.requires_grad_(True)
    h = sharpen.entropy_sum(cut, torch.ones(1, 1))
    h.backward()
    assert float(h.detach()) == 0.0 and torch.isfinite(cut.grad).all()


def continues_entropy(trainer: PPOTrainer, sharpen: Sharpen, rows) -> float:
    b = collate(rows, 0)
    with torch.no_grad():
        logits, _ = trainer.model(b.input_ids, b.attention_mask)
    return float(sharpen.entropy_sum(b.sampled_logits(logits), b.mask) / b.mask.sum())


def test_training_with_sharpen_lowers_the_entropy_and_leaves_the_stop_probability(tok, sharpen, champion_dir) -> None:
    """Rows whose reward teaches nothing (zero: the PPO terms are flat) still get sharper where the line goes on."""
    from training.stop_credit import clean_stop_ids

    rows = [served(tok, "rejected", None, rid=f"r{i}") for i in range(16)]
    c = cfg(sharpen_coef=1.0, learning_rate=3e-3, passes=4, batch_size=16, kl_coef=0.0)
    trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, sharpen=sharpen)
    stops = torch.tensor(clean_stop_ids(tok, "\n"))

    def p_abstain() -> float:  # the probability of stopping at the first position of a row
        b = collate(rows[:1], 0)
        with torch.no_grad():
            logits, _ = trainer.model(b.input_ids, b.attention_mask)
        return float(b.sampled_logits(logits)[0, 0].softmax(-1)[stops].sum())

    before, abstain_before = continues_entropy(trainer, sharpen, rows), p_abstain()
    trainer.compute_reference(rows)
    metrics = trainer.train(rows, iteration_plan(len(rows), c))
    after = continues_entropy(trainer, sharpen, rows)
    assert after < before - 0.3, (before, after)
    assert all(m["ppo/sharpen_loss"] > 0 for m in metrics)
    assert abs(p_abstain() - abstain_before) < 0.05, (abstain_before, p_abstain())


def test_sharpen_needs_its_weight_and_its_term_together(tok, sharpen, champion_dir) -> None:
    model = make_trainer(champion_dir, cfg()).model
    with pytest.raises(ValueError, match="sharpen_coef=1.0 needs a Sharpen"):
        PPOTrainer(model, cfg(sharpen_coef=1.0), 0)
    with pytest.raises(ValueError, match="sharpen_coef=0.0 needs a Sharpen"):
        PPOTrainer(model, cfg(), 0, sharpen=sharpen)
    with pytest.raises(ValueError, match="sharpen_coef=-1"):
        cfg(sharpen_coef=-1)
    with pytest.raises(ValueError, match="sharpen_coef > 0 is implemented for backend='hf' only"):
        cfg(sharpen_coef=1.0, backend="megatron", lora=False)


def test_distillation_targets_the_reference_at_the_temperature_given_that_the_line_continues(tok, sharpen) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 3, len(tok), generator=gen) * 3
    mask = torch.ones(2, 3)
    at_target = float(sharpen.distill_sum(ref / 0.5, ref, mask, 0.5))
    # the cross-entropy is least (the target's entropy) when the policy is the target; higher at the reference
    assert at_target < float(sharpen.distill_sum(ref, ref, mask, 0.5))
    assert at_target < float(sharpen.distill_sum(ref / 0.4, ref, mask, 0.5))
    # stop logits play no part on either side
    moved = ref.clone()
    moved[..., sharpen.stop_ids] += 5.0
    assert float(sharpen.distill_sum(moved / 0.5, ref, mask, 0.5)) == pytest.approx(at_target, rel=1e-5)


@pytest.mark.parametrize("lora", [True, False], ids=["adapter", "full-weights"])
def test_training_with_a_sharpen_temperature_moves_towards_the_sharper_reference(tok, sharpen, champion_dir, lora) -> None:
    """The reference is the model with its adapter off, or (every weight trained) a frozen copy of the start."""
    rows = [served(tok, "rejected", None, rid=f"r{i}") for i in range(16)]
    c = cfg(
        sharpen_coef=1.0,
        sharpen_temperature=0.5,
        learning_rate=3e-3 if lora else 3e-4,
        passes=4,
        batch_size=16,
        kl_coef=0.0,
        lora=lora,
    )
    trainer = PPOTrainer(make_trainer(champion_dir, cfg(lora=lora)).model, c, 0, sharpen=sharpen)
    b = collate(rows, 0)
    with torch.no_grad():
        ref, _ = trainer.model(b.input_ids, b.attention_mask)
    ref = b.sampled_logits(ref)

    def gap() -> float:  # the policy's cross-entropy from the target, per token
        with torch.no_grad():
            logits, _ = trainer.model(b.input_ids, b.attention_mask)
        return float(sharpen.distill_sum(b.sampled_logits(logits), ref, b.mask, 0.5) / b.mask.sum())

    before = gap()
    trainer.compute_reference(rows)
    trainer.train(rows, iteration_plan(len(rows), c))
    assert gap() < before - 0.2, (before, gap())
    with pytest.raises(ValueError, match="sharpen_temperature=1.5: must lie in"):
        cfg(sharpen_coef=1.0, sharpen_temperature=1.5)
