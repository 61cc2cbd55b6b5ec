"""Canary statistics and decision rule: the mSPRT and its confidence sequence, CanaryConfig's checks,
each guardrail of `look()` firing with its reason, and `Ramp` stepping only when a step is complete."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError

from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth, History, Outcome
from release.operations import log_plan
from release.policy import Ramp, look
from release.stats import Summary, cuped, fit_mixture_sd, msprt, plan_step, stratified_msprt
from tidal.model_settings import Margins

ALPHA = 0.05


# --- mSPRT ---------------------------------------------------------------------------------------


def test_summary_of_values() -> None:
    assert Summary.of([1.0, 2.0, 3.0]) == Summary(3, 2.0, 1.0)  # unbiased variance: /(n - 1)
    assert Summary.of([]) == Summary(0, 0.0, 0.0)
    assert Summary.of([5.0]) == Summary(1, 5.0, 0.0)


def bernoulli(rng: np.random.Generator, p: float, n: int) -> Summary:
    return Summary.of(rng.binomial(1, p, n).astype(float).tolist())


def test_identical_arms_are_not_significant() -> None:
    rng = np.random.default_rng(1)
    c = msprt("accepted", bernoulli(rng, 0.3, 3000), bernoulli(rng, 0.3, 3000), ALPHA, 0.2)
    assert not c.significant and not c.worse and not c.better
    assert c.low < 0 < c.high and c.p_value > ALPHA
    exact = Summary(1000, 0.3, 0.21)
    same = msprt("accepted", exact, exact, ALPHA, 0.2)
    assert same.delta == 0 and same.log_lambda < 0 and same.p_value == 1.0  # the mixture penalises no effect


def test_a_big_difference_is_significant_with_its_sign() -> None:
    rng = np.random.default_rng(2)
    control, canary = bernoulli(rng, 0.3, 2000), bernoulli(rng, 0.45, 2000)
    up = msprt("accepted", control, canary, ALPHA, 0.2)
    assert up.significant and up.better and not up.worse
    assert up.delta > 0 and up.low > 0 and up.p_value < ALPHA
    assert up.relative == pytest.approx(up.delta / control.mean)
    down = msprt("accepted", canary, control, ALPHA, 0.2)
    assert down.worse and not down.better and down.high < 0 and down.delta == pytest.approx(-up.delta)


def test_significance_is_exactly_the_bounds_excluding_zero() -> None:
    """The confidence sequence is the test inverted: 0 leaves [low, high] exactly when Lambda >= 1/alpha,
    and p = 1/Lambda <= alpha there."""
    control = Summary(800, 0.30, 0.21)
    for delta in np.linspace(-0.12, 0.12, 49):
        c = msprt("accepted", control, Summary(400, 0.30 + delta, 0.21), ALPHA, 0.2)
        if abs(c.log_lambda - math.log(1 / ALPHA)) < 1e-9:
            continue  # on the boundary itself rounding decides
        assert c.significant == (c.low > 0 or c.high < 0), delta
        assert c.significant == (c.p_value <= ALPHA), delta


def test_the_lower_bound_at_another_level() -> None:
    """low_at(alpha) is the same confidence sequence at another level: the test's own bound at its alpha, a
    higher (narrower) one at a larger level, none before the test is made."""
    c = msprt("accepted", Summary(800, 0.30, 0.21), Summary(400, 0.33, 0.21), ALPHA, 0.2)
    assert c.low_at(ALPHA) == pytest.approx(c.low)
    assert c.low < c.low_at(0.2) < c.low_at(0.5) < c.delta
    twin = msprt("accepted", Summary(800, 0.30, 0.21), Summary(400, 0.33, 0.21), 0.2, 0.2)
    assert c.low_at(0.2) == pytest.approx(twin.low)
    assert msprt("accepted", Summary(10, 0.3, 0.21), Summary(10, 0.3, 0.21), ALPHA, 0.2).low_at(0.2) == -math.inf


def test_confidence_bounds_contain_the_true_delta() -> None:
    """Always-valid bounds hold at every n at once, so at one fixed n they cover at least 1 - alpha."""
    rng = np.random.default_rng(3)
    true_delta, covered, trials = 0.05, 0, 300
    for _ in range(trials):
        c = msprt("accepted", bernoulli(rng, 0.30, 400), bernoulli(rng, 0.35, 400), ALPHA, 0.2)
        covered += c.low <= true_delta <= c.high
    assert covered >= (1 - ALPHA) * trials


def test_too_few_outcomes_decide_nothing_and_bad_parameters_are_refused() -> None:
    c = msprt("reward", Summary(1, 0.75, 0.0), Summary(500, -0.25, 0.1), ALPHA, 0.2)
    assert not c.significant and (c.low, c.high, c.p_value) == (-math.inf, math.inf, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        msprt("reward", Summary(9, 0, 1), Summary(9, 0, 1), 1.0, 0.2)
    with pytest.raises(ValueError, match="mixture_sd"):
        msprt("reward", Summary(9, 0, 1), Summary(9, 0, 1), ALPHA, 0.0)


# --- stratification, CUPED, the power plan, the fitted mixture --------------------------------------


def test_one_stratum_is_the_plain_test() -> None:
    control, canary = Summary(800, 0.30, 0.21), Summary(400, 0.36, 0.23)
    plain, strat = msprt("r", control, canary, ALPHA, 0.2), stratified_msprt("r", [[(control, canary)]], ALPHA, 0.2)
    assert strat.delta == pytest.approx(plain.delta) and strat.low == pytest.approx(plain.low)
    assert strat.log_lambda == pytest.approx(plain.log_lambda)


def test_strata_remove_the_spread_between_kinds_and_the_bias_of_a_trend() -> None:
    """Two kinds accepted at 10% and 50%: within kinds the arms are equal. Pooled, the spread between kinds is noise;
    and when the canary's share of the two kinds differs (its weight rose while the mix changed), the pooled
    difference is biased: here the pooled test calls an equal canary worse; the stratified one does not."""
    rng = np.random.default_rng(5)
    low_c, low_k = bernoulli(rng, 0.1, 4000), bernoulli(rng, 0.1, 3000)  # the canary got more of the hard kind
    high_c, high_k = bernoulli(rng, 0.5, 4000), bernoulli(rng, 0.5, 500)
    from release.stats import _merge

    pooled = msprt("a", _merge([low_c, high_c]), _merge([low_k, high_k]), ALPHA, 0.2)
    strat = stratified_msprt("a", [[(low_c, low_k), (high_c, high_k)]], ALPHA, 0.2)
    assert pooled.worse and pooled.delta < -0.1  # Simpson's paradox
    assert not strat.significant and abs(strat.delta) < 0.03 and strat.low < 0 < strat.high
    # the summaries reported are every outcome of each arm
    assert (strat.control.n, strat.canary.n) == (8000, 3500)


def test_kinds_are_weighted_by_traffic_and_steps_by_precision() -> None:
    """A change that helps one kind more than the other: the estimate is the average over the traffic's mix of
    kinds (post-stratification), not tilted towards the less noisy kind. Two steps measuring the same effect are
    combined by precision: the one with more canary outcomes counts more."""
    hard = (Summary(5000, 0.10, 0.09), Summary(5000, 0.12, 0.1056))  # +0.02
    easy = (Summary(5000, 0.50, 0.25), Summary(5000, 0.60, 0.24))  # +0.10
    mixed = stratified_msprt("a", [[hard, easy]], ALPHA, 0.2)
    assert mixed.delta == pytest.approx(0.06)
    small = (Summary(1000, 0.3, 0.21), Summary(50, 0.5, 0.25))
    large = (Summary(1000, 0.3, 0.21), Summary(1000, 0.35, 0.2275))
    steps = stratified_msprt("a", [[small], [large]], ALPHA, 0.2)
    assert 0.05 < steps.delta < 0.07  # dominated by the 1,000-outcome step's +0.05, not the mean of +0.2 and +0.05


def test_a_thin_stratum_waits_until_both_arms_have_outcomes_in_it() -> None:
    full = (Summary(500, 0.3, 0.21), Summary(500, 0.3, 0.21))
    thin = (Summary(500, 0.9, 0.09), Summary(3, 0.0, 0.0))
    alone = stratified_msprt("a", [[full]], ALPHA, 0.2, min_stratum_n=10)
    both = stratified_msprt("a", [[full, thin]], ALPHA, 0.2, min_stratum_n=10)
    # the thin stratum's 0.9 vs 0.0 does not enter the difference (tau, from all outcomes, moves the bounds a little)
    assert both.delta == pytest.approx(alone.delta) and both.high == pytest.approx(alone.high, rel=0.01)
    assert both.canary.n == 503


def test_cuped_keeps_the_difference_and_removes_what_history_explains() -> None:
    rng = np.random.default_rng(6)
    n = 4000
    skill = rng.normal(0, 1, n)  # a user's propensity, seen in the history and in the outcome
    history = skill + rng.normal(0, 0.5, n)
    canary = rng.random(n) < 0.5
    y = skill + 0.1 * canary + rng.normal(0, 1, n)
    adjusted = cuped(y, history)
    raw_delta = y[canary].mean() - y[~canary].mean()
    adj_delta = adjusted[canary].mean() - adjusted[~canary].mean()
    assert abs(adj_delta - 0.1) < abs(raw_delta - 0.1) + 0.02 and abs(adj_delta - 0.1) < 0.06
    assert adjusted.var() < 0.65 * y.var()  # R^2 = 1 / (1 + 0.25) * 1 / 2 ~ 0.4
    missing = history.copy()
    missing[:100] = np.nan
    partly = cuped(y, missing)
    assert np.array_equal(partly[:100], y[:100]) and partly[100:].var() < y[100:].var()
    assert np.array_equal(cuped(y, np.full(n, 2.0)), y)  # a constant covariate explains nothing
    assert np.array_equal(cuped(y[:2], history[:2]), y[:2])  # too few to fit


def test_the_power_plan_matches_the_simulated_test() -> None:
    """plan_step's detect_requests: the requests at which a regression of effect_sd is rolled back with >= 80%
    probability. Checked by sampling the test's statistic at that n (the final look alone: a conservative count)."""
    cfg = CanaryConfig()
    plan = plan_step(0.05, 0.13, cfg.alpha / 2, cfg.mixture_sd)
    assert plan.weight == 0.05 and plan.clear_requests < plan.detect_requests
    assert plan_step(0.5, 0.13, cfg.alpha / 2, cfg.mixture_sd).detect_requests < plan.detect_requests / 5
    rng = np.random.default_rng(7)
    n_k = plan.detect_canary
    n_c = plan.detect_requests - n_k
    rolled = 0
    for _ in range(400):
        control = Summary(n_c, float(rng.normal(0.0, 1 / math.sqrt(n_c))), 1.0)
        canary = Summary(n_k, float(rng.normal(-0.13, 1 / math.sqrt(n_k))), 1.0)
        rolled += msprt("r", control, canary, cfg.alpha / 2, cfg.mixture_sd).worse
    assert 0.74 <= rolled / 400 <= 0.9, rolled
    assert [p.weight for p in cfg.plan()] == cfg.steps
    # a step clears at its advance level: sooner at a larger one, with the same requests to roll back
    loose = plan_step(0.05, 0.13, cfg.alpha / 2, cfg.mixture_sd, clear_alpha=0.2)
    assert loose.clear_requests < plan.clear_requests and loose.detect_requests == plan.detect_requests
    assert cfg.plan()[0] == plan_step(0.05, 0.13, cfg.alpha / 2, cfg.mixture_sd, clear_alpha=cfg.advance_risk)
    with pytest.raises(ValueError, match="weight"):
        plan_step(1.0, 0.13, 0.025, 0.2)


def test_the_mixture_is_fitted_to_past_effects() -> None:
    rng = np.random.default_rng(8)
    effects = [(float(rng.normal(0, math.sqrt(0.15**2 + 0.01))), 0.01) for _ in range(2000)]
    assert fit_mixture_sd(effects) == pytest.approx(0.15, abs=0.015)
    assert fit_mixture_sd([(0.0, 0.01)]) == 0.05  # no effect seen: the floor
    with pytest.raises(ValueError, match="at least one"):
        fit_mixture_sd([])


# --- CanaryConfig --------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [[], [0.25, 0.05], [0.05, 0.05, 0.5], [0.05, 1.0], [0.0, 0.5]])
def test_steps_must_be_increasing_shares_strictly_inside_0_1(steps: list[float]) -> None:
    with pytest.raises(ValidationError, match=r"canary.steps=.*need increasing shares in \(0, 1\)"):
        CanaryConfig(steps=steps)


def test_config_defaults_and_typos() -> None:
    cfg = CanaryConfig()
    assert (cfg.steps, cfg.min_samples, cfg.alpha, cfg.primary) == ([0.05, 0.25, 0.5], 50, 0.05, "reward")
    assert cfg.advance_risk == 0.2
    assert (cfg.margins.accepted_chars, cfg.margins.error_rate, cfg.margins.slow_share) == (0.05, 0.02, 0.01)
    with pytest.raises(ValidationError, match="min_sample"):
        CanaryConfig(min_sample=100)  # extra keys are typos


# --- look(): guardrails, primary, step end --------------------------------------------------------

# A step advances once a regression of 0.5 sd is excluded: 300 canary against 1,000 control outcomes do that
# (half-width ~0.21 sd); the default 0.13 sd needs far more (test_a_step_advances_only_once_the_regression_is_excluded).
CFG = CanaryConfig(min_samples=200, max_step_s=600, detect_regression_sd=0.5)


def outcomes(
    arm: str, n: int, accept_every: int = 10, accepts_per: int = 3, chars: float = 20.0, latency_ms: float = 100.0
) -> list[Outcome]:
    """n deterministic outcomes: `accepts_per` of every `accept_every` accepted (30% by default), each
    accepted one keeping `chars` characters; rewards as the default rule (+0.75 / -0.25)."""
    out = []
    for i in range(n):
        ok = i % accept_every < accepts_per
        out.append(Outcome(arm, 0.75 if ok else -0.25, float(ok), chars if ok else 0.0, latency_ms + i % 7, i))
    return out


SAME = outcomes("control", 1000) + outcomes("canary", 300)
HEALTHY = {"control": ArmHealth(1000, 10), "canary": ArmHealth(300, 3)}
# Promotion needs the error-rate excess shown under its 2% margin: 3 errors in 300 requests leave it possible
# (upper bound ~2.4%), none in 300 against none in 1,000 do not.
CLEAN = {"control": ArmHealth(1000), "canary": ArmHealth(300)}


def test_equal_arms_advance_once_the_step_is_complete() -> None:
    assert look(CFG, 0, SAME, 300, 60.0, HEALTHY).action == "advance"
    assert look(CFG, 0, SAME, 150, 60.0, HEALTHY).action == "wait"  # step not complete yet
    last = look(CFG, 2, SAME, 300, 60.0, HEALTHY)
    assert last.action == "wait" and "canary outcomes" in last.reason  # no improvement: no promotion


def test_probe_failure_rolls_back() -> None:
    res = look(CFG, 0, SAME, 300, 60.0, HEALTHY, probe_ok=False)
    assert res.action == "rollback" and "served-weight check failed" in res.reason


def test_error_rate_guardrail() -> None:
    res = look(CFG, 0, SAME, 300, 60.0, {"control": ArmHealth(1000, 10), "canary": ArmHealth(300, 30)})
    assert res.action == "rollback" and res.reason.startswith("error rate 10.000% vs control 1.000% (excess in [")
    within = look(CFG, 0, SAME, 300, 60.0, {"control": ArmHealth(1000, 10), "canary": ArmHealth(300, 8)})
    assert within.action == "advance"  # 2.7% vs 1%: inside the +2% allowance
    unsure = look(CFG, 0, SAME, 300, 60.0, {"control": ArmHealth(1000, 10), "canary": ArmHealth(300, 15)})
    assert unsure.action == "advance"  # 5% vs 1%: above the allowance, but not with always-valid confidence
    # ... and at the last step, that uncertainty blocks a promotion: the excess is not shown under the margin
    better = outcomes("control", 1000) + outcomes("canary", 300, accepts_per=5)
    held = look(CFG, 2, better, 300, 60.0, {"control": ArmHealth(1000, 10), "canary": ArmHealth(300, 15)})
    assert held.action == "wait" and "not shown non-inferior: error rate excess" in held.reason, held.reason
    few = look(CFG, 0, SAME, 100, 60.0, {"control": ArmHealth(1000, 10), "canary": ArmHealth(20, 10)})
    assert few.action != "rollback"  # fewer than min_test_samples canary requests: not judged yet


def test_p99_latency_guardrail() -> None:
    slow = outcomes("control", 1000) + outcomes("canary", 300, latency_ms=400.0)
    res = look(CFG, 0, slow, 300, 60.0, HEALTHY)
    assert res.action == "rollback" and res.reason.startswith("p99 latency 406 ms vs control 106 ms: 100.0% of canary")
    few = outcomes("control", 1000) + outcomes("canary", 20, latency_ms=400.0)
    assert look(CFG, 0, few, 20, 60.0, HEALTHY).action == "wait"  # fewer than min_test_samples: not judged yet
    quick = outcomes("control", 1000) + outcomes("canary", 60, latency_ms=400.0)
    assert look(CFG, 0, quick, 60, 60.0, HEALTHY).action == "rollback"  # every request slow: clear long before a step ends


def test_a_fresh_engines_few_slow_requests_do_not_fail_the_latency_guardrail() -> None:
    """As a canary on a freshly booted replica did in a demo: its two slowest of 167 requests took 570 and 789 ms
    against control's p99 of 286 ms, the rest as fast as control. Its sample p99 is 4x control's; the share of
    slow requests (1.2%) is no evidence that its p99 passes the allowance."""
    control = outcomes("control", 1000)
    canary = [replace(o, latency_ms=ms) for o, ms in zip(outcomes("canary", 167), [570.0, 789.0] + [100.0] * 165)]
    res = look(CFG, 0, control + canary, 167, 60.0, HEALTHY)
    assert res.action == "wait" and res.figures["p99_ms_canary"] > 4 * res.figures["p99_ms_control"], res
    assert res.comparisons["slow_share"].canary.n == 167 and not res.comparisons["slow_share"].low > 0.01


def test_accepted_chars_guardrail_fires_before_the_primary() -> None:
    """Same accept rate and reward, but accepted suggestions keep a quarter of the characters."""
    terse = outcomes("control", 1000) + outcomes("canary", 300, chars=5.0)
    res = look(CFG, 0, terse, 300, 60.0, HEALTHY)
    assert res.action == "rollback" and res.reason.startswith("accepted chars per request fell: 1.500 vs 6.000")
    assert not res.comparisons["reward"].significant


def test_primary_fell_rolls_back() -> None:
    """Fewer accepts (10% vs 30%) with 3x the characters each: chars per request equal, reward lower."""
    data = outcomes("control", 1000) + outcomes("canary", 300, accepts_per=1, chars=60.0)
    res = look(CFG, 0, data, 300, 60.0, HEALTHY)
    assert res.action == "rollback" and res.reason.startswith("reward fell: -0.1500 vs 0.0500")


def test_a_waiting_step_says_when_it_expects_its_samples_and_when_it_gives_up() -> None:
    """The line `tidal promote` prints each look: 10 of 150 outcomes in 20 s is 0.5/s, ~280 s to go; max_step_s 1800."""
    cfg = CanaryConfig(min_samples=150, max_step_s=1800.0)
    res = look(cfg, 0, SAME, 10, 20.0, HEALTHY)
    assert res.action == "wait" and res.reason == (
        "10/150 canary outcomes at 5%; ~5 min to 150 at 0.50/s; inconclusive in 30 min without a decision"
    ), res.reason
    assert look(cfg, 0, SAME, 0, 20.0, HEALTHY).reason == "0/150 canary outcomes at 5%; inconclusive in 30 min without a decision"
    assert "inconclusive in 60 s without a decision" in look(cfg, 0, SAME, 300, 1740.0, HEALTHY).reason


def test_a_step_advances_only_once_the_regression_is_excluded() -> None:
    """With the default detect_regression_sd (0.13 sd), 300 equal canary outcomes leave a regression that size
    possible (half-width ~0.21 sd): the step waits. 3,000 against 9,000 exclude it (~0.07 sd)."""
    cfg = CanaryConfig()
    few = look(cfg, 0, SAME, 300, 60.0, HEALTHY)
    assert few.action == "wait" and few.reason.startswith("undecided after 300 canary outcomes at 5%"), few.reason
    assert few.margins["reward"] == pytest.approx(0.13 * math.sqrt(few.comparisons["reward"].control.var), rel=0.01)
    many = outcomes("control", 9000) + outcomes("canary", 3000)
    res = look(cfg, 0, many, 3000, 60.0, {"control": ArmHealth(9000), "canary": ArmHealth(3000)})
    assert res.action == "advance" and res.reason.startswith(
        "reward and accepted_chars not worse than control by 0.13 sd at risk 0.2 after 3000 canary outcomes at 5% "
        "(reward delta >= "
    ), res.reason
    assert "allowed -0.0596; accepted_chars delta >= " in res.reason, res.reason


def test_a_step_advances_at_its_own_risk_level() -> None:
    """Advancing releases nothing, so the step's test runs at advance_risk, not at alpha/2: 800 equal canary
    outcomes against 2,400 leave a 0.13 sd regression possible at 0.025 (half-width ~0.136 sd), not at 0.2 (~0.106)."""
    data = outcomes("control", 2400) + outcomes("canary", 800)
    health = {"control": ArmHealth(2400), "canary": ArmHealth(800)}
    strict = look(CanaryConfig(advance_risk=0.025), 0, data, 800, 60.0, health)
    assert strict.action == "wait", strict.reason
    res = look(CanaryConfig(advance_risk=0.2), 0, data, 800, 60.0, health)
    assert res.action == "advance" and " at risk 0.2 after 800 " in res.reason, res.reason
    assert res.comparisons["reward"].low < -res.margins["reward"]  # the alpha/2 bound alone would not have let it pass
    # better on reward, 20% fewer accepted characters per request: not shown worse than the guardrail's margin yet,
    # and held at its step, which must exclude that regression as well before more users see it
    shorter = outcomes("control", 2400) + outcomes("canary", 800, accepts_per=4, chars=12.0)
    held = look(CanaryConfig(advance_risk=0.2), 0, shorter, 800, 60.0, health)
    assert held.comparisons["reward"].better and held.action == "wait", held.reason
    assert "step regression not excluded at risk 0.2: accepted_chars delta >= " in held.reason, held.reason
    with pytest.raises(ValidationError, match="advance_risk"):
        CanaryConfig(advance_risk=0.0)


def test_promotion_needs_every_guardrail_shown_non_inferior() -> None:
    """Reward clearly up (50% vs 30% accepted) with suggestions a third the length: accepted characters per request
    fall from 6.0 to 3.5. Not enough to be shown worse by more than the 5% margin at first, and never shown within it:
    no promotion, ever; with more data the loss is shown and the ramp rolls back."""
    short = outcomes("control", 1000) + outcomes("canary", 300, accepts_per=5, chars=7.0)
    res = look(CFG, 2, short, 300, 60.0, HEALTHY)
    assert res.comparisons["reward"].better and res.action != "promote", res.reason
    chars = res.comparisons["accepted_chars"]
    assert res.action == "rollback" or "not shown non-inferior: accepted chars" in res.reason, res.reason
    assert chars.low < -res.margins["accepted_chars"] and res.margins["accepted_chars"] == pytest.approx(0.05 * 6.0)
    # a model that tolerates a larger loss (its own margins) promotes the same canary
    loose = look(CFG, 2, short, 300, 60.0, CLEAN, margins=Margins(accepted_chars=0.9))
    assert loose.action == "promote" and "guardrails non-inferior" in loose.reason, loose.reason


def test_promotion_needs_the_last_step_and_a_significant_improvement() -> None:
    better = outcomes("control", 1000) + outcomes("canary", 300, accepts_per=5)  # 50% vs 30% accepted
    assert look(CFG, 1, better, 300, 60.0, HEALTHY).action == "advance"  # not the last step
    assert look(CFG, 2, better, 150, 60.0, HEALTHY).action == "wait"  # last step, not complete
    assert look(CFG, 2, better, 300, 60.0, HEALTHY).action == "wait"  # 1% errors: the 2% margin not shown yet
    res = look(CFG, 2, better, 300, 60.0, CLEAN)
    assert res.action == "promote" and res.reason.startswith("reward rose: 0.2500 vs 0.0500")


def test_a_step_without_decision_is_inconclusive_at_max_step_s() -> None:
    res = look(CFG, 2, SAME, 300, 600.0, HEALTHY)
    assert res.action == "inconclusive" and res.reason.startswith("no decision within 600 s at 50%")
    assert look(CFG, 0, SAME, 10, 600.0, HEALTHY).action == "inconclusive"  # also for a step short of samples


def test_a_step_bounded_by_outcomes_waits_for_traffic_however_long_it_takes() -> None:
    """max_step_outcomes ends an undecided step after that many outcomes of both arms, not after a time: a step in a
    trough of traffic waits (here 590 s into a 600-s limit would still wait) until the evidence is there."""
    cfg = CFG.model_copy(update={"max_step_outcomes": 1300, "max_step_s": 1e6})
    waiting = look(cfg, 2, SAME, 300, 590.0, HEALTHY, step_n=1299)
    assert waiting.action == "wait" and "or 1 more outcomes without a decision" in waiting.reason, waiting.reason
    assert look(cfg, 2, SAME, 300, 5000.0, HEALTHY, step_n=1299).action == "wait"  # no time limit to speak of
    done = look(cfg, 2, SAME, 300, 20.0, HEALTHY, step_n=1300)
    assert done.action == "inconclusive" and done.reason.startswith("no decision within 1300 outcomes at 50%"), done.reason
    assert done.figures["step_n"] == 1300
    assert look(cfg, 2, SAME, 300, 20.0, HEALTHY).action == "inconclusive"  # step_n defaults to every outcome given
    # the bound ends a step that has not decided; a decision within it stands
    assert look(cfg, 0, SAME, 300, 20.0, HEALTHY, step_n=5000).action == "advance"
    # and the time limit still applies when it comes first
    assert look(cfg.model_copy(update={"max_step_s": 60.0}), 2, SAME, 300, 60.0, HEALTHY, step_n=10).action == "inconclusive"


def test_a_ramp_counts_each_steps_outcomes_of_both_arms_from_its_own_start() -> None:
    cfg = CFG.model_copy(update={"max_step_outcomes": 1500, "max_step_s": 1e6})
    ramp, control = Ramp(cfg, now_s=0.0), outcomes("control", 1000)
    assert ramp.observe(control + outcomes("canary", 200), HEALTHY, 10.0).action == "advance"  # 1,200 outcomes
    # step 2 has seen 1,000 + 399 - 1,200 = 199 outcomes of its own: far from its bound of 1,500
    look_1 = ramp.observe(control + outcomes("canary", 399), HEALTHY, 20.0)
    assert (look_1.action, look_1.figures["step_n"], ramp.step) == ("wait", 199, 1), look_1.reason
    # 3,300 - 1,200 = 2,100 outcomes in the step, 100 of them the canary's (short of min_samples): the bound ends it
    last = ramp.observe(control * 3 + outcomes("canary", 300), HEALTHY, 30.0)
    assert last.action == "inconclusive" and last.reason.startswith("no decision within 1500 outcomes at 25%"), last.reason


def test_an_outcome_bound_the_first_step_cannot_fill_is_refused_with_its_fix() -> None:
    with pytest.raises(ValueError, match=r"max_step_outcomes=100 would end the first step \(5% of traffic\).*at least 1000"):
        CanaryConfig(max_step_outcomes=100)
    assert CanaryConfig(max_step_outcomes=1000).max_step_outcomes == 1000


def test_two_rejected_canary_outcomes_are_no_evidence() -> None:
    """No test decides before both arms have min_test_samples outcomes (two equal outcomes have variance 0)."""
    data = outcomes("control", 48) + [Outcome("canary", -0.25, 0.0, 0.0, 100.0, 0)] * 2
    res = look(CFG, 0, data, 2, 5.0, {"control": ArmHealth(48), "canary": ArmHealth(2)})
    assert res.action == "wait", res.reason


# --- Ramp ----------------------------------------------------------------------------------------


def test_ramp_advances_per_complete_step_then_promotes_or_times_out() -> None:
    ramp = Ramp(CFG, now_s=0.0)
    control = outcomes("control", 2000)
    assert ramp.observe(control + outcomes("canary", 199), HEALTHY, 10.0).action == "wait" and ramp.step == 0
    assert ramp.observe(control + outcomes("canary", 200), HEALTHY, 20.0).action == "advance"
    assert (ramp.step, ramp.weight) == (1, 0.25)
    # the new step counts only canary outcomes it collected itself
    assert ramp.observe(control + outcomes("canary", 399), HEALTHY, 30.0).action == "wait" and ramp.step == 1
    assert ramp.observe(control + outcomes("canary", 400), HEALTHY, 40.0).action == "advance"
    assert (ramp.step, ramp.weight) == (2, 0.5)
    # last step complete, equal arms: no promotion, waiting until max_step_s after the step began (40 s)
    assert ramp.observe(control + outcomes("canary", 600), HEALTHY, 639.0).action == "wait"
    assert ramp.observe(control + outcomes("canary", 600), HEALTHY, 640.0).action == "inconclusive"
    assert [lk.step for lk in ramp.looks] == [0, 0, 1, 1, 2, 2] and ramp.step == 2

    winner, clean = Ramp(CFG, now_s=0.0), {"control": ArmHealth(2000), "canary": ArmHealth(600)}
    for n in (200, 400):
        assert winner.observe(control + outcomes("canary", n, accepts_per=5), clean, n / 10).action == "advance"
    assert winner.observe(control + outcomes("canary", 600, accepts_per=5), clean, 60.0).action == "promote"


def test_the_plan_warns_when_the_first_step_cannot_decide_within_its_time_or_its_outcomes(caplog) -> None:
    """log_plan sizes the first step by power; at the last hour's rate (3,600 requests in canary.history_s = 1 h: 1/s)
    it names the bound that ends the step first, with the fix."""
    log, history = logging.getLogger("plan-test"), {"u": History(3600, 0.0, 0.0, 0.0)}
    need = CanaryConfig().plan()[0].detect_requests  # requests the default first step (5%) needs: thousands
    with caplog.at_level(logging.INFO, "plan-test"):
        log_plan(CanaryConfig(max_step_s=need + 10.0), history, log)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, "plan-test"):
        log_plan(CanaryConfig(max_step_s=need - 10.0, max_step_outcomes=need - 1), history, log)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "within max_step_s" in warned[0], warned
    assert f"~{need} outcomes" in warned[1] and f"max_step_outcomes={need - 1}" in warned[1], warned
