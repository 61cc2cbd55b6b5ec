"""Split credit for partial verdicts: the kept characters earn their accept on the last token kept, the first
token not kept pays the rest, nothing after it; the row's total reward is unchanged."""

from __future__ import annotations

import pytest
import torch

from data_contracts.rewards import RewardRule
from tests.unit.ppo_helpers import cfg, make_trainer
from tests.unit.test_hindsight import TEXT, boundaries, served
from training.partial_credit import CreditedSample, credit_partials, partial_rows
from training.policy import load_tokenizer
from training.ppo_loss import kl_penalized_rewards
from training.ppo_trainer import iteration_plan
from training.rollout import collate


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


def partial(tok, k: int, rule: RewardRule = RewardRule(), rid: str = "r1"):
    s = served(tok, "partial", k, rid=rid)
    return s.model_copy(update={"reward": rule.reward("partial", k, TEXT)})


@pytest.mark.parametrize("extra", [0, 1])  # on a token boundary, and one character into the next token
def test_the_kept_tokens_earn_the_accept_and_the_first_token_not_kept_pays_the_rest(tok, extra) -> None:
    rule = RewardRule()
    k = boundaries(tok, TEXT)[1] + extra  # two served tokens wholly kept
    [row] = credit_partials([partial(tok, k, rule)], tok, rule).samples
    assert isinstance(row, CreditedSample) and row.kept_tokens == 2
    r = row.token_rewards()
    assert r[1] == rule.accepted  # what stopping after the kept text would have earned
    assert r[2] == pytest.approx(rule.reward("partial", k, TEXT) - rule.accepted) and r[2] < 0
    assert r[0] == 0 and all(x == 0 for x in r[3:])
    assert sum(r) == pytest.approx(row.reward)


def test_a_partial_kept_inside_its_first_token_keeps_its_whole_reward_on_that_token(tok) -> None:
    k = boundaries(tok, TEXT)[0] - 1
    assert k >= 1, "the first token of TEXT must span several characters"
    [row] = credit_partials([partial(tok, k)], tok, RewardRule()).samples
    assert row.kept_tokens == 0 and row.token_rewards() == [row.reward] + [0.0] * (len(row.completion_token_ids) - 1)


def test_a_scaled_rule_charges_nothing_for_going_on(tok) -> None:
    rule = RewardRule(accept_scale_by_chars=True)  # a partial earns exactly what its kept characters earn
    [row] = credit_partials([partial(tok, boundaries(tok, TEXT)[1], rule)], tok, rule).samples
    r = row.token_rewards()
    assert r[1] == pytest.approx(row.reward) and r[2] == pytest.approx(0.0)


def test_other_verdicts_pass_unchanged_and_partials_without_kept_characters_are_counted(tok) -> None:
    rows = [
        served(tok, "accepted", None, rid="a"),
        served(tok, "rejected", None, rid="b"),
        served(tok, "partial", 0, rid="c"),
        partial(tok, boundaries(tok, TEXT)[1], rid="d"),
    ]
    out = credit_partials(rows, tok, RewardRule())
    assert out.samples[:3] == rows[:3] and not any(isinstance(s, CreditedSample) for s in out.samples[:3])
    assert out.credited == 1 and out.kept_tokens == 2 and out.skipped == {"no_chars_kept": 1}


def test_partial_rows_apply_the_aids_the_config_turns_on(tok) -> None:
    rows = [served(tok, "accepted", None, rid="a"), partial(tok, boundaries(tok, TEXT)[1], rid="p")]
    plain = partial_rows(rows, tok, RewardRule(), cfg())
    assert plain.samples == rows and plain.credit is None and plain.hindsight.samples == []
    both = partial_rows(rows, tok, RewardRule(), cfg(hindsight_partials=True, partial_credit="kept_prefix"))
    assert [s.request_id for s in both.samples] == ["a", "p", "p#hindsight"]
    assert isinstance(both.samples[1], CreditedSample) and both.credit.credited == 1


def test_the_batch_carries_each_rows_token_rewards_and_the_kl_penalty_adds_to_them(tok) -> None:
    rule = RewardRule()
    rows = credit_partials(
        [served(tok, "rejected", None, rid="a"), partial(tok, boundaries(tok, TEXT)[1], rule)], tok, rule
    ).samples
    rows[0] = rows[0].model_copy(update={"reward": rule.rejected})
    b = collate(rows, pad_token_id=0)
    T = len(rows[0].completion_token_ids)
    assert b.token_rewards[0].tolist() == [0.0] * (T - 1) + [rule.rejected]
    assert b.token_rewards[1].tolist() == pytest.approx(rows[1].token_rewards())
    assert b.rewards.tolist() == pytest.approx([r.reward for r in rows]) and b.served.all()
    logp_old, logp_ref = torch.full(b.mask.shape, -1.0), torch.full(b.mask.shape, -1.5)
    per_token = kl_penalized_rewards(b.token_rewards, logp_old, logp_ref, b.mask, kl_coef=0.1)
    assert per_token == pytest.approx(b.token_rewards - 0.05 * b.mask)
    # the (B,) form puts the same totals on the last token
    terminal = kl_penalized_rewards(b.rewards, logp_old, logp_ref, b.mask, kl_coef=0.1)
    assert terminal.sum(1) == pytest.approx(per_token.sum(1))


def test_ppo_with_split_credit_makes_the_first_wrong_token_less_likely_and_the_last_kept_one_more(champion_dir, tok) -> None:
    """The same positive partials (the user kept two tokens, then the text went wrong). Credited on the last token,
    every token shares one positive return; split, the wrong token's return is negative and the kept ones' positive.
    (Without the reward on the last token the critic's start values move the other tokens: compare, don't pin.)"""
    rule = RewardRule()
    rows = [partial(tok, boundaries(tok, TEXT)[1], rule, rid=f"r{i}") for i in range(32)]
    assert rows[0].reward > 0
    changes = {}
    for credit in ("last_token", "kept_prefix"):
        c = cfg(partial_credit=credit, whiten_advantages=False, kl_coef=0.0, passes=2)
        trainer = make_trainer(champion_dir, c)
        shaped = partial_rows(rows, tok, rule, c).samples
        before = trainer.token_logprobs(shaped[:1])[0]  # (T,) log pi of the served tokens
        trainer.compute_reference(shaped)
        trainer.train(shaped, iteration_plan(len(shaped), c))
        changes[credit] = trainer.token_logprobs(shaped[:1])[0] - before  # (T,)
    kept, wrong = 1, 2  # the last token the user kept, the first they did not
    assert changes["kept_prefix"][wrong] < 0 < changes["kept_prefix"][kept], changes
    assert changes["kept_prefix"][wrong] < changes["last_token"][wrong] - 0.3, changes
