"""Kept credit: at every position inside the characters a user kept, every token that would have shown the next
kept characters is known to be right; training raises their probability (the expected right tokens)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.ppo_helpers import cfg, make_trainer
from tests.unit.test_hindsight import TEXT, boundaries, served
from training.kept_credit import KeptCredit
from training.policy import load_tokenizer
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.rollout import collate


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


@pytest.fixture(scope="module")
def credit(tok):
    return KeptCredit(tok)


def test_the_right_tokens_are_every_token_showing_the_next_kept_characters(tok, credit) -> None:
    right = credit.right_tokens("append(item)")
    texts = {tok.decode([v]) for v in right}
    assert texts and all("append(item)".startswith(t) for t in texts)
    # every token of the vocabulary whose text is a prefix of the rest, and no other
    assert set(right) == {
        v
        for v in range(len(tok))
        if tok.decode([v]) and "append(item)".startswith(tok.decode([v])) and "\ufffd" not in tok.decode([v])
    }


def test_a_partial_credits_the_positions_inside_its_kept_characters_only(tok, credit) -> None:
    ends = boundaries(tok, TEXT)  # characters shown after each served token
    k = ends[1]  # the user kept the first two served tokens' text
    pairs = credit.pairs(served(tok, "partial", k, rid="p"))
    positions = sorted({j for j, _ in pairs})
    assert positions == [0, 1]  # position 2 starts at the kept characters' end: what comes next is unknown
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert (0, ids[0]) in pairs and (1, ids[1]) in pairs  # the served tokens were right there
    assert all(TEXT[:k].startswith(tok.decode([v])) for j, v in pairs if j == 0)
    # a cut one character into a longer token: there, the right tokens show only that character
    i = next(i for i in range(1, len(ids)) if ends[i] - ends[i - 1] >= 2)
    inside = credit.pairs(served(tok, "partial", ends[i - 1] + 1, rid="p2"))
    assert {j for j, _ in inside} == set(range(i + 1)) and (i, ids[i]) not in inside
    assert all(len(tok.decode([v])) == 1 for j, v in inside if j == i)


def test_an_accepted_suggestion_credits_every_position_and_rejections_and_silence_none(tok, credit) -> None:
    n = len(tok.encode(TEXT, add_special_tokens=False))
    assert {j for j, _ in credit.pairs(served(tok, "accepted", len(TEXT), rid="a"))} == set(range(n))
    assert credit.pairs(served(tok, "rejected", None, rid="r")) == []
    assert credit.pairs(served(tok, "partial", 0, rid="z")) == []
    assert credit.pairs(served(tok, "none", None, text="", rid="e").model_copy(update={"completion_token_ids": []})) == []


def test_gain_is_the_summed_probability_of_the_right_tokens_of_the_selected_rows(tok, credit) -> None:
    rows = [served(tok, "partial", boundaries(tok, TEXT)[1], rid="p"), served(tok, "rejected", None, rid="r")]
    triples = credit.batch(rows)
    assert triples.shape[1] == 3 and set(triples[:, 0].tolist()) == {0}
    logits = torch.randn(2, 4, len(tok), requires_grad=True)
    p = logits.softmax(-1)
    expect = sum(float(p[0, j, v]) for j, v in credit.pairs(rows[0]))
    assert float(credit.gain(logits, triples, torch.tensor([0, 1]))) == pytest.approx(expect, rel=1e-5)
    # the minibatch holds only the second row (at position 0 of its logits): no credited position
    assert float(credit.gain(logits[1:], triples, torch.tensor([1]))) == 0.0
    # the first row alone, as the only row of a minibatch
    assert float(credit.gain(logits[:1], triples, torch.tensor([0]))) == pytest.approx(expect, rel=1e-5)
    credit.gain(logits, triples, torch.tensor([0, 1])).backward()
    assert logits.grad[0].abs().sum() > 0 and logits.grad[1].abs().sum() == 0


def right_prob(trainer: PPOTrainer, credit: KeptCredit, s) -> float:
    b = collate([s], 0)
    with torch.no_grad():
        logits, _ = trainer.model(b.input_ids, b.attention_mask)
    t = credit.batch([s])
    return float(credit.gain(b.sampled_logits(logits), t, torch.tensor([0]))) / len({int(j) for j in t[:, 1]})


def test_training_with_kept_credit_raises_the_right_tokens_probability(tok, credit, champion_dir) -> None:
    """Rows whose reward alone teaches nothing (zero: the PPO terms are flat) still move the kept tokens' mass."""
    k = boundaries(tok, TEXT)[2]
    rows = [served(tok, "partial", k, rid=f"p{i}") for i in range(16)]
    c = cfg(kept_credit_coef=4.0, learning_rate=3e-3, passes=4, batch_size=16, kl_coef=0.0)
    trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, kept=credit)
    before = right_prob(trainer, credit, rows[0])
    trainer.compute_reference(rows)
    metrics = trainer.train(rows, iteration_plan(len(rows), c))
    after = right_prob(trainer, credit, rows[0])
    assert after > before + 0.05, (before, after)
    assert all("ppo/kept_credit_loss" in m and m["ppo/kept_credit_loss"] < 0 for m in metrics)


def test_kept_credit_needs_its_weight_and_its_table_together(tok, credit, champion_dir) -> None:
    model = make_trainer(champion_dir, cfg()).model
    with pytest.raises(ValueError, match="kept_credit_coef=1.0 needs a KeptCredit"):
        PPOTrainer(model, cfg(kept_credit_coef=1.0), 0)
    with pytest.raises(ValueError, match="kept_credit_coef=0.0 needs a KeptCredit"):
        PPOTrainer(model, cfg(), 0, kept=credit)
    with pytest.raises(ValueError, match="kept_credit_coef=-1"):
        cfg(kept_credit_coef=-1)
    with pytest.raises(ValueError, match="kept_credit_coef > 0 is implemented for backend='hf' only"):
        cfg(kept_credit_coef=1.0, backend="megatron", lora=False)
