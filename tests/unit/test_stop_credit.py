"""Stop credit: what stopping before each token of a logged suggestion would have earned, read from the verdict,
and the gradient that moves the policy's stop probability towards it."""

from __future__ import annotations

import pytest
import torch

from data_contracts.rewards import RewardRule
from tests.unit.ppo_helpers import cfg, make_trainer
from tests.unit.test_hindsight import TEXT, boundaries, served
from training.policy import load_tokenizer
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.rollout import collate
from training.stop_credit import BUDGET_PENALTY, StopCredit, clean_stop_ids, stop_token_ids


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


def rewarded(tok, event: str, kept: int | None, rule: RewardRule, rid: str = "r1", stop: bool = True):
    """A served suggestion of TEXT (ended by the line-break token when `stop`), rewarded by `rule`."""
    s = served(tok, event, kept, rid=rid)
    if stop:
        (nl,) = tok.encode("\n", add_special_tokens=False)
        s = s.model_copy(
            update={"completion_token_ids": s.completion_token_ids + [nl], "behaviour_logprobs": s.behaviour_logprobs + [-0.5]}
        )
    return s.model_copy(update={"reward": rule.reward(event, kept if event == "partial" else None, TEXT)})


def test_stop_tokens_are_every_token_holding_the_line_break(tok) -> None:
    ids = stop_token_ids(tok)
    assert tok.encode("\n", add_special_tokens=False)[0] in ids
    assert all("\n" in tok.decode([i]) for i in ids) and len(ids) < len(tok) / 4


def test_the_credited_stop_is_a_token_that_shows_nothing_more(tok) -> None:
    """pi(stop) sums the tokens that begin with the line break: a token such as ')\\n' ends the suggestion too, but
    shows one more character, whose verdict the row does not tell."""
    ends, clean = set(stop_token_ids(tok)), set(clean_stop_ids(tok))
    assert clean < ends  # this tokenizer has tokens with text before their line break
    assert all(tok.decode([i]).startswith("\n") for i in clean)
    credit = StopCredit(tok, RewardRule())
    assert set(credit.stop_ids.tolist()) == clean
    logits = torch.full((1, 1, len(tok)), -30.0)
    mid = next(iter(ends - clean))
    logits[0, 0, mid] = 30.0  # all the mass on a stop token with text before its line break
    assert float(credit.stop_prob(logits)) < 1e-6
    logits[0, 0, next(iter(clean))] = 30.0
    assert float(credit.stop_prob(logits)) == pytest.approx(0.5, abs=1e-6)


def test_a_rejected_suggestion_credits_abstaining_and_every_cut_as_rejected(tok) -> None:
    rule = RewardRule()
    s = rewarded(tok, "rejected", None, rule)
    adv, known = StopCredit(tok, rule).advantages(s)
    assert adv[0] == pytest.approx(rule.empty - rule.rejected) and adv[0] > 0  # showing nothing beats a rejection
    assert all(known[:-1]) and adv[1:-1] == pytest.approx([0.0] * (len(adv) - 2))  # every cut is rejected too
    assert known[-1] is False  # the sampled stop itself keeps its PPO term only


@pytest.mark.parametrize("scaled", [False, True])
def test_a_partial_credits_the_cut_at_its_kept_characters_and_every_longer_cut(tok, scaled) -> None:
    rule = RewardRule(accept_scale_by_chars=scaled)
    ends = boundaries(tok, TEXT)
    k = ends[1]  # the user kept the first two served tokens
    s = rewarded(tok, "partial", k, rule)
    adv, known = StopCredit(tok, rule).advantages(s)
    # before token 2 the cut shows exactly the kept text: it would have been accepted
    assert known[2] and adv[2] == pytest.approx(rule.reward("accepted", None, TEXT[:k]) - s.reward)
    assert (adv[2] > 0) == (not scaled)  # the constant rule pays more for stopping there; the scaled one the same
    assert not known[1]  # a shorter non-empty cut: the user's minimum length decides, unknown
    for j in range(3, len(ends)):  # longer cuts: partials of k kept characters
        assert known[j] and adv[j] == pytest.approx(rule.reward("partial", k, TEXT[: ends[j - 1]]) - s.reward)
    assert known[0] and adv[0] == pytest.approx(-s.reward)  # abstaining loses what the user kept


def test_accepted_and_unjudged_rows_credit_only_what_is_known(tok) -> None:
    rule = RewardRule()
    adv, known = StopCredit(tok, rule).advantages(rewarded(tok, "accepted", None, rule))
    assert known[0] and adv[0] == pytest.approx(-rule.accepted) and not any(known[1:])
    none = rewarded(tok, "rejected", None, rule).model_copy(update={"event": "none", "reward": 0.0})
    assert not any(StopCredit(tok, rule).advantages(none)[1])


def test_without_abstain_credit_only_where_a_shown_suggestion_ends_is_credited(tok) -> None:
    rule = RewardRule()
    ends = boundaries(tok, TEXT)
    rejected, partial = rewarded(tok, "rejected", None, rule), rewarded(tok, "partial", ends[1], rule)
    full, shown = StopCredit(tok, rule), StopCredit(tok, rule, abstain=False)
    for s in (rejected, partial):
        (a_full, k_full), (a, k) = full.advantages(s), shown.advantages(s)
        assert k_full[0] and not k[0]  # showing nothing is never credited
        assert (a[1:], k[1:]) == (a_full[1:], k_full[1:])  # every later position as before
    # a rejection then teaches nothing at all: every shown cut is rejected too
    assert all(x == 0.0 for x in shown.advantages(rejected)[0])


def stop_at(trainer: PPOTrainer, credit: StopCredit, s, j: int) -> float:
    """pi(stop) before completion token j of `s` under the trainer's policy."""
    b = collate([s], 0)
    with torch.no_grad():
        logits, _ = trainer.model(b.input_ids, b.attention_mask)
    return float(credit.stop_prob(b.sampled_logits(logits))[0, j])


def test_training_with_stop_credit_abstains_where_suggestions_are_rejected_and_stops_where_users_kept(tok, champion_dir) -> None:
    rule = RewardRule()
    k = boundaries(tok, TEXT)[1]
    rejected = [rewarded(tok, "rejected", None, rule, rid=f"r{i}") for i in range(16)]
    rows = rejected
    c = cfg(stop_credit_coef=4.0, learning_rate=3e-3, passes=6, batch_size=16, kl_coef=0.0)
    credit = StopCredit(tok, rule)
    trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, stop=credit)
    before = stop_at(trainer, credit, rows[0], 0)
    trainer.compute_reference(rows)
    trainer.train(rows, iteration_plan(len(rows), c))
    after = stop_at(trainer, credit, rows[0], 0)
    assert after > before + 0.05, (before, after)

    partials = [rewarded(tok, "partial", k, rule, rid=f"p{i}") for i in range(16)]
    trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, stop=credit)
    before = stop_at(trainer, credit, partials[0], 2)
    trainer.compute_reference(partials)
    metrics = trainer.train(partials, iteration_plan(len(partials), c))
    after = stop_at(trainer, credit, partials[0], 2)
    assert after > before + 0.05, (before, after)
    assert all("ppo/stop_credit_loss" in m for m in metrics)


def test_stop_credit_needs_its_weight_and_its_table_together(tok, champion_dir) -> None:
    model = make_trainer(champion_dir, cfg()).model
    with pytest.raises(ValueError, match="stop_credit_coef=1.0 needs a StopCredit"):
        PPOTrainer(model, cfg(stop_credit_coef=1.0), 0)
    with pytest.raises(ValueError, match="stop_credit_coef=0.0 needs a StopCredit"):
        PPOTrainer(model, cfg(), 0, stop=StopCredit(tok, RewardRule()))
    with pytest.raises(ValueError, match="stop_credit_coef=-1"):
        cfg(stop_credit_coef=-1)
    with pytest.raises(ValueError, match="stop_credit_coef > 0 is implemented for backend='hf' only"):
        cfg(stop_credit_coef=1.0, backend="megatron", lora=False)


def test_the_abstain_budget_penalises_only_the_share_above_it(tok) -> None:
    p = torch.tensor([[0.5, 0.9], [0.1, 0.9], [0.9, 0.0]], requires_grad=True)  # (b, T) pi(stop)
    first = torch.tensor([1.0, 1.0, 0.0])  # the third row has no first token: not counted
    assert float(StopCredit.over_budget(p, first, 0.4)) == 0.0  # the share is 0.3
    penalty = StopCredit.over_budget(p, first, 0.2)
    assert float(penalty) == pytest.approx(BUDGET_PENALTY * 0.1)
    penalty.backward()
    assert p.grad[:2, 0].tolist() == pytest.approx([BUDGET_PENALTY / 2] * 2) and float(p.grad[:, 1:].abs().sum()) == 0
    assert float(p.grad[2, 0]) == 0.0


def test_with_an_abstain_budget_rejections_teach_silence_only_up_to_it(tok, champion_dir) -> None:
    rule = RewardRule()
    rows = [rewarded(tok, "rejected", None, rule, rid=f"r{i}") for i in range(16)]
    after = {}
    for budget in (1.0, 0.1):
        c = cfg(stop_credit_coef=4.0, abstain_budget=budget, learning_rate=3e-3, passes=6, batch_size=16, kl_coef=0.0)
        credit = StopCredit(tok, rule)
        trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, stop=credit)
        trainer.compute_reference(rows)
        trainer.train(rows, iteration_plan(len(rows), c))
        after[budget] = stop_at(trainer, credit, rows[0], 0)
    assert after[1.0] > 0.2 and after[0.1] < 0.15, after
    with pytest.raises(ValueError, match="abstain_budget=0.5 caps what stop credit teaches"):
        cfg(abstain_budget=0.5)
    with pytest.raises(ValueError, match="abstain_budget=0.0: must be in"):
        cfg(stop_credit_coef=1.0, abstain_budget=0.0)


def test_log_abstain_credit_divides_only_the_abstain_gradient_by_its_probability() -> None:
    p = torch.tensor([[0.05, 0.5], [0.5, 0.2]], requires_grad=True)  # (b, T) pi(stop)
    adv, known = torch.tensor([[0.25, 0.25], [-0.5, 0.25]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    grads = {}
    for log in (False, True):
        p.grad = None
        StopCredit.credit_loss(p, adv, known, abstain_log=log).backward()
        grads[log] = p.grad.clone()
    # the exact term's gradient is -(R_stop - R) everywhere credited; log divides position 0's by pi(abstain)
    assert grads[False].flatten().tolist() == pytest.approx([-0.25, -0.25, 0.5, 0.0])
    assert grads[True].flatten().tolist() == pytest.approx([-0.25 / 0.05, -0.25, 0.5 / 0.5, 0.0])


def test_log_abstain_credit_moves_a_rare_abstain_faster_and_needs_its_budget(tok, champion_dir) -> None:
    rule = RewardRule()
    rows = [rewarded(tok, "rejected", None, rule, rid=f"r{i}") for i in range(16)]
    after = {}
    for credit_form in ("probability", "log"):
        c = cfg(
            stop_credit_coef=1.0, abstain_budget=0.9, abstain_credit=credit_form, learning_rate=1e-3, batch_size=16, kl_coef=0.0
        )
        credit = StopCredit(tok, rule)
        trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, stop=credit)
        before = stop_at(trainer, credit, rows[0], 0)
        trainer.compute_reference(rows)
        trainer.train(rows, iteration_plan(len(rows), c))
        after[credit_form] = stop_at(trainer, credit, rows[0], 0) - before
    assert after["log"] > 2 * after["probability"] > 0, after
    with pytest.raises(ValueError, match="abstain_credit='log' weighs the abstain decision"):
        cfg(stop_credit_coef=1.0, abstain_credit="log")  # no budget


def test_abstaining_against_the_best_cut_weighs_a_partial_by_what_its_kept_text_would_have_earned(tok) -> None:
    rule = RewardRule()
    ends = boundaries(tok, TEXT)
    partial, rejected = rewarded(tok, "partial", ends[1], rule), rewarded(tok, "rejected", None, rule, rid="r2")
    plain, best = StopCredit(tok, rule), StopCredit(tok, rule, abstain_vs_best_cut=True)
    a_plain, a_best = plain.advantages(partial)[0], best.advantages(partial)[0]
    assert a_plain[0] == pytest.approx(-partial.reward)  # the row's own reward: 0.75 x kept / shown
    assert a_best[0] == pytest.approx(rule.empty - rule.accepted)  # the cut at the kept text: accepted
    assert a_best[0] < a_plain[0]
    assert a_best[1:] == a_plain[1:]  # every other position as before
    assert best.advantages(rejected) == plain.advantages(rejected)  # every cut of a rejection is rejected: no change


def test_the_stop_anchor_is_zero_at_the_reference_and_spares_the_abstain_decision() -> None:
    q = torch.tensor([[0.05, 0.1, 0.3], [0.5, 0.2, 0.9]])  # (b, T) the reference's pi(stop)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second row has two completion tokens
    assert float(StopCredit.anchor_sum(q.clone(), q, mask)) == pytest.approx(0.0, abs=1e-6)
    p = q.clone()
    p[:, 0] = 0.9  # abstaining moved: not charged
    p[1, 2] = 0.01  # past the row's end: not charged
    assert float(StopCredit.anchor_sum(p, q, mask)) == pytest.approx(0.0, abs=1e-6)
    p = q.clone().requires_grad_(True)
    drifted = p * torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 1.0]])  # stopping doubled before the second token
    loss = StopCredit.anchor_sum(drifted, q, mask)
    loss.backward()
    assert float(loss) > 0 and float(p.grad[0, 1]) > 0  # it pulls the stop probability back down
    with pytest.raises(ValueError, match="stop_anchor_coef=1.0 holds what stop credit moves"):
        cfg(stop_anchor_coef=1.0)


def test_with_the_stop_anchor_abstain_credit_leaks_less_into_stopping_mid_suggestion(tok, champion_dir) -> None:
    rule = RewardRule()
    rows = [rewarded(tok, "rejected", None, rule, rid=f"r{i}") for i in range(16)]
    drift = {}
    for anchor in (0.0, 4.0):
        c = cfg(
            stop_credit_coef=1.0,
            abstain_budget=0.9,
            abstain_credit="log",
            stop_anchor_coef=anchor,
            learning_rate=1e-3,
            batch_size=16,
            kl_coef=0.0,
        )
        credit = StopCredit(tok, rule)
        trainer = PPOTrainer(make_trainer(champion_dir, cfg()).model, c, 0, stop=credit)
        before = [stop_at(trainer, credit, rows[0], j) for j in (0, 2)]
        trainer.compute_reference(rows)
        metrics = trainer.train(rows, iteration_plan(len(rows), c))
        after = [stop_at(trainer, credit, rows[0], j) for j in (0, 2)]
        assert after[0] > before[0]  # abstaining learned either way
        assert ("ppo/stop_anchor_loss" in metrics[-1]) == (anchor > 0)  # logged only where it is trained
        drift[anchor] = abs(after[1] - before[1])
    assert drift[4.0] < 0.5 * drift[0.0], drift
