"""PPO's pure loss functions: log-probs, KL-penalised rewards, GAE, truncated IS, clipped losses."""

from __future__ import annotations

import math

import pytest
import torch

from training.ppo_loss import (
    gae,
    kl_penalized_rewards,
    masked_mean,
    masked_whiten,
    ppo_losses,
    token_entropy,
    token_logprobs,
    truncated_is_weight,
)

EPS = 0.2


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _losses(logp_new, logp_old, adv, mask, w=None, **kw):
    """ppo_losses with a dummy critic (values = returns = 0) and IS weight 1 unless given."""
    zeros = torch.zeros_like(logp_old)
    w = torch.ones_like(logp_old) if w is None else w
    return ppo_losses(logp_new, logp_old, adv, zeros, zeros, zeros, w, mask, EPS, 0.2, **kw)


# --- token log-probs and helpers -----------------------------------------------------------------


def test_token_logprobs_and_entropy_match_manual_computation() -> None:
    logits = torch.randn(2, 3, 7, generator=_gen())
    tokens = torch.randint(0, 7, (2, 3), generator=_gen(1))
    got = token_logprobs(logits.to(torch.bfloat16), tokens)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    got = token_logprobs(logits, tokens)
    for b in range(2):
        for t in range(3):
            row = [math.exp(x) for x in logits[b, t].tolist()]
            want = math.log(row[tokens[b, t]] / sum(row))
            assert got[b, t].item() == pytest.approx(want, abs=1e-5)
            probs = [x / sum(row) for x in row]
            ent = -sum(p * math.log(p) for p in probs)
            assert token_entropy(logits)[b, t].item() == pytest.approx(ent, abs=1e-5)


def test_masked_mean_and_whiten_ignore_padding() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.5)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 4.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    w = masked_whiten(x, mask)
    real = w[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.pow(2).mean().item() == pytest.approx(1.0, abs=1e-5)  # population std 1
    assert w[1, 1:].tolist() == [0.0, 0.0]


# --- policy loss ---------------------------------------------------------------------------------


def test_on_policy_gradient_equals_plain_policy_gradient() -> None:
    """r = 1 and mu = pi (weight 1): PPO's gradient is -mean(A * grad log pi) over real tokens."""
    g = _gen(2)
    logits = torch.randn(2, 4, 6, generator=g, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 4), generator=g)
    adv = torch.randn(2, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])

    logp = token_logprobs(logits, tokens)
    w = truncated_is_weight(logp.detach(), logp.detach(), mask, C=2.0)
    assert torch.equal(w, mask.float())
    parts = _losses(logp, logp.detach(), adv, mask, w=w)
    (ppo_grad,) = torch.autograd.grad(parts.policy_loss, logits)

    plain = -(adv * token_logprobs(logits, tokens) * mask).sum() / mask.sum()
    (pg_grad,) = torch.autograd.grad(plain, logits)
    assert ppo_grad.abs().sum() > 0
    torch.testing.assert_close(ppo_grad, pg_grad, rtol=1e-5, atol=1e-7)
    assert parts.approx_kl.item() == pytest.approx(0.0, abs=1e-7)
    assert parts.clipfrac.item() == 0.0


def test_clipping_engages_exactly_at_the_bounds() -> None:
    d = 1e-3
    ratios = torch.tensor([[1 + EPS + d, 1 + EPS - d, 1 - EPS - d, 1 - EPS - d, 1 - EPS + d, 1 + EPS + d, 5.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])  # the last (padding) token is far outside the clip
    # A>0: clipped only above 1+eps.  A<0: clipped only below 1-eps.
    clipped = torch.tensor([[True, False, False, True, False, False, False]])

    logp_old = torch.full((1, 7), -1.5)
    logp_new = (logp_old + ratios.log()).requires_grad_()
    parts = _losses(logp_new, logp_old, adv, mask)
    parts.policy_loss.backward()
    grad = logp_new.grad
    assert torch.all(grad[clipped] == 0)
    free = ~clipped & mask.bool()
    assert torch.all(grad[free] != 0)
    # d(-A r)/d logp_new = -A r, averaged over the 6 real tokens
    torch.testing.assert_close(grad[free], (-adv * ratios / 6)[free], rtol=1e-4, atol=1e-7)
    assert parts.clipfrac.item() == pytest.approx(2 / 6)


def test_is_weight_scales_each_tokens_policy_gradient() -> None:
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    w = torch.tensor([[2.0, 0.5, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    logp_old = torch.full((1, 4), -1.0)
    logp_new = logp_old.clone().requires_grad_()  # r = 1: inside the clip everywhere
    _losses(logp_new, logp_old, adv, mask, w=w).policy_loss.backward()
    torch.testing.assert_close(logp_new.grad, -w * adv * mask / 3)


def test_value_loss_takes_the_max_of_clipped_and_unclipped() -> None:
    # token 0: v moved 0.5 towards R=1 -> clipped v 0.2 is worse -> (0.2-1)^2 = 0.64, no gradient
    # token 1: v moved 0.5 away from R=0 -> unclipped is worse -> 0.25, gradient v - R
    # token 2: within the clip -> both equal (0.1-1)^2 = 0.81
    v_old = torch.zeros(1, 3)
    ret = torch.tensor([[1.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.1]], requires_grad=True)
    mask = torch.ones(1, 3)
    zeros, ones = torch.zeros(1, 3), torch.ones(1, 3)
    parts = ppo_losses(zeros, zeros, zeros, v, v_old, ret, ones, mask, EPS, 0.2)
    assert parts.value_loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.81) / 3)
    parts.value_loss.backward()
    assert v.grad[0, 0] == 0 and v.grad[0, 1].item() == pytest.approx(0.5 / 3)
    plain = ppo_losses(zeros, zeros, zeros, v, v_old, ret, ones, mask, EPS, None)
    assert plain.value_loss.item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.81) / 3)


def test_diagnostics_and_total() -> None:
    ratios = torch.tensor([[0.5, 2.0, 1.0]])
    logp_old = torch.zeros(1, 3)
    w = torch.tensor([[2.0, 1.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    ent = torch.tensor([[1.0, 3.0, 50.0]])
    parts = _losses(ratios.log(), logp_old, torch.ones(1, 3), mask, w=w, entropy=ent, is_truncation=2.0)
    k3 = [(r - 1) - math.log(r) for r in (0.5, 2.0)]
    assert parts.approx_kl.item() == pytest.approx(sum(k3) / 2)
    assert parts.is_weight_mean.item() == pytest.approx(1.75)
    assert parts.is_truncated_frac.item() == pytest.approx(0.5)
    assert parts.entropy.item() == pytest.approx(2.0)
    total = parts.total(vf_coef=0.5, entropy_coef=0.1)
    assert total.item() == pytest.approx(parts.policy_loss.item() + 0.5 * parts.value_loss.item() - 0.2)
    assert not parts.approx_kl.requires_grad


# --- truncated importance weights ----------------------------------------------------------------


def test_truncation_engages_exactly_at_C() -> None:
    C, d = 2.0, 1e-4
    log_ratio = torch.tensor([[math.log(C) - d, math.log(C) + d, 0.0, -1.0]])
    mu = torch.full((1, 4), -2.0)
    mask = torch.ones(1, 4)
    w = truncated_is_weight(mu + log_ratio, mu, mask, C)
    assert w[0, 0].item() == pytest.approx(C * math.exp(-d), rel=1e-6) and w[0, 0].item() < C
    assert w[0, 1].item() == C
    assert w[0, 2].item() == pytest.approx(1.0)
    assert w[0, 3].item() == pytest.approx(math.exp(-1.0), rel=1e-6)
    parts = _losses(mu + log_ratio, mu + log_ratio, torch.ones(1, 4), mask, w=w, is_truncation=C)
    assert parts.is_truncated_frac.item() == pytest.approx(0.25)


def test_sequence_level_uses_the_summed_log_ratio() -> None:
    C = 2.0
    log_ratio = torch.tensor([[0.4, 0.4, 0.0], [0.3, -0.2, 7.0]])  # 7.0 sits on padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    mu = torch.zeros(2, 3)
    tok = truncated_is_weight(log_ratio, mu, mask, C, level="token")
    torch.testing.assert_close(tok, log_ratio.exp() * mask)  # every token below C
    seq = truncated_is_weight(log_ratio, mu, mask, C, level="sequence")
    assert seq[0].tolist() == [C, C, 0.0]  # exp(0.8) = 2.23 > C
    assert seq[1].tolist() == pytest.approx([math.exp(0.1), math.exp(0.1), 0.0], rel=1e-6)


def test_is_weight_is_safe_for_non_finite_inputs() -> None:
    logp_old = torch.tensor([[-1.0, -1.0, -1.0, float("nan")], [-1.0, -1.0, 0.0, 0.0]])
    mu = torch.tensor([[float("-inf"), float("nan"), -1.0, -1.0], [-1.0, float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tok = truncated_is_weight(logp_old, mu, mask, 2.0)
    assert tok.tolist() == [[2.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    seq = truncated_is_weight(logp_old, mu, mask, 2.0, level="sequence")
    assert torch.isfinite(seq).all() and seq.abs().sum() == 0  # a NaN drops its whole sequence
    ok = truncated_is_weight(
        torch.tensor([[50.0, 50.0]]), torch.tensor([[-50.0, -50.0]]), torch.ones(1, 2), 2.0, level="sequence"
    )
    assert ok.tolist() == [[2.0, 2.0]]
    with pytest.raises(ValueError, match="level"):
        truncated_is_weight(logp_old, mu, mask, 2.0, level="batch")  # type: ignore[arg-type]


# --- rewards and GAE -----------------------------------------------------------------------------


def test_kl_penalized_rewards_put_the_terminal_reward_on_the_last_real_token() -> None:
    logp_old = torch.tensor([[-1.0, -2.0, -1.0, -9.0], [-1.0, -1.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    logp_ref = torch.tensor([[-1.5, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    r = kl_penalized_rewards(torch.tensor([0.75, -0.25, 5.0]), logp_old, logp_ref, mask, kl_coef=0.1)
    want = [[-0.05, 0.0, 0.05 + 0.75, 0.0], [0.0, 0.0, 0.0, -0.25], [0.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(r, torch.tensor(want))
    with pytest.raises(ValueError, match="right-padded"):
        kl_penalized_rewards(torch.zeros(1), torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[0, 1, 1]]), 0.1)


def test_weighted_kl_penalty_on_behaviour_samples_is_a_penalty_not_a_length_bonus() -> None:
    # One state, three actions. Tokens were sampled from mu = pi_ref; the policy has since moved.
    ref = torch.tensor([0.6, 0.3, 0.1])
    pi = torch.tensor([0.2, 0.5, 0.3])
    logp_old, logp_ref = pi.log().view(3, 1), ref.log().view(3, 1)  # (B=3 actions, T=1)
    mask = torch.ones(3, 1)
    w = truncated_is_weight(logp_old, logp_ref, mask, C=10.0)  # pi / mu, untruncated here
    weighted = kl_penalized_rewards(torch.zeros(3), logp_old, logp_ref, mask, kl_coef=1.0, is_weight=w)
    plain = kl_penalized_rewards(torch.zeros(3), logp_old, logp_ref, mask, kl_coef=1.0)
    kl_pi_ref = float((pi * (pi / ref).log()).sum())
    # Expected per-token reward under mu: the weighted estimate is exactly -KL(pi || ref) ...
    assert float((ref * weighted.view(3)).sum()) == pytest.approx(-kl_pi_ref, rel=1e-5)
    # ... while the unweighted one is +KL(ref || pi) > 0: a reward for every extra token.
    kl_ref_pi = float((ref * (ref / pi).log()).sum())
    assert kl_ref_pi > 0 and float((ref * plain.view(3)).sum()) == pytest.approx(kl_ref_pi, rel=1e-5)


def test_gae_matches_a_hand_computed_example() -> None:
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[-0.1, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # delta_2 = 1.0 + 0.9*0   - 0.7 = 0.3          A_2 = 0.3
    # delta_1 = 0.0 + 0.9*0.7 - 0.6 = 0.03         A_1 = 0.03  + 0.72*0.3   = 0.246
    # delta_0 = -0.1 + 0.9*0.6 - 0.5 = -0.06       A_0 = -0.06 + 0.72*0.246 = 0.11712
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma, lam)
    assert adv[0].tolist() == pytest.approx([0.11712, 0.246, 0.3], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.61712, 0.846, 1.0], abs=1e-6)


def test_gae_handles_padded_sequences_of_different_lengths() -> None:
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[-0.1, 0.0, 1.0, 99.0, 99.0], [0.1, 0.2, 0.3, 0.4, -1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 99.0, 99.0], [0.0, 0.1, -0.2, 0.3, 0.4]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv[0].tolist() == pytest.approx([0.11712, 0.246, 0.3, 0.0, 0.0], abs=1e-6)
    assert ret[0, 3:].tolist() == [0.0, 0.0]
    alone, alone_ret = gae(rewards[1:], values[1:], mask[1:], gamma, lam)
    torch.testing.assert_close(adv[1:], alone)
    torch.testing.assert_close(ret[1:], alone_ret)


def test_gae_with_lambda_and_gamma_one_is_monte_carlo_return_minus_value() -> None:
    g = _gen(3)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    mc = (rewards * mask).flip(1).cumsum(1).flip(1)  # sum of this and later real rewards
    torch.testing.assert_close(adv, (mc - values) * mask)
    torch.testing.assert_close(ret, mc * mask)


@pytest.mark.parametrize("reward", [0.75, -0.25])
def test_advantage_signs_follow_the_terminal_reward(reward: float) -> None:
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logp = torch.full((2, 4), -1.0)
    rewards = kl_penalized_rewards(torch.full((2,), reward), logp, logp, mask, kl_coef=0.05)
    adv, _ = gae(rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=0.95)
    real = adv[mask.bool()]
    assert torch.all(real > 0) if reward > 0 else torch.all(real < 0)
    assert torch.all(adv[~mask.bool()] == 0)
