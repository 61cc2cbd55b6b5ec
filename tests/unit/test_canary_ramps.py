"""Acceptance checks of the canary ramp, driven by the seeded outcome simulator (release/ramp_simulation.py):
A/A false alarms within alpha, a clearly degraded canary stopped at the first step, a better one promoted.

Every ramp is seeded, so the counts below are deterministic. Cost grows with the square of the requests
in a ramp (each look re-reads every outcome since the canary started), so the A/A ramps use a smaller
min_samples than production; the always-valid error bound does not depend on it, and the early looks,
where a canary has only a handful of outcomes, are the same as with the default.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from data_contracts.rewards import RewardRule
from release.canary_config import CanaryConfig
from release.policy import look
from release.ramp_simulation import ArmModel, Population, RampResult, _serve, run_ramp, sample

RATE_RPS = 20.0  # assumed traffic; looks every 100 requests = the default poll_s (5 s) at this rate
BASE = ArmModel(accept_p=0.3)


def ramps(cfg: CanaryConfig, canary: ArmModel, seeds: range, look_every: int) -> list[RampResult]:
    # max_requests far beyond max_step_s * rate * steps: every ramp ends by the policy's own decision
    return [run_ramp(cfg, (BASE, canary), seed, RATE_RPS, look_every, max_requests=10**6) for seed in seeds]


def test_simulator_is_seeded_and_follows_routing_errors_and_the_reward_rule() -> None:
    cfg = CanaryConfig(min_samples=50, max_step_s=90.0)
    first = run_ramp(cfg, (BASE, ArmModel(0.12)), 7, RATE_RPS, 100, 10**6)
    assert first == run_ramp(cfg, (BASE, ArmModel(0.12)), 7, RATE_RPS, 100, 10**6)
    arms = (BASE, ArmModel(0.3, error_rate=0.5))
    users = np.random.default_rng(1).random(10_000)
    outs, canary, failed = _serve(np.random.default_rng(0), arms, RewardRule(), users, 0.25, 0, 4000, RATE_RPS)
    assert abs(canary.mean() - (users < 0.25).mean()) < 0.03  # a user is on the canary iff u < weight
    assert not failed[~canary].any() and abs(failed[canary].mean() - 0.5) < 0.05
    assert len(outs) == 4000 - failed.sum()  # failed requests leave no outcome
    assert {o.reward for o in outs} == {0.75, -0.25}  # the default rule: nothing empty, every verdict known
    assert all((o.reward == 0.75) == (o.accepted == 1.0) == (o.accepted_chars > 0) for o in outs)
    assert outs[-1].time_ms < 4000 / RATE_RPS * 1000
    with pytest.raises(ValueError, match="accept_p"):
        ArmModel(accept_p=1.5)


# --- A/A: both arms identical ---------------------------------------------------------------------

# step 0 needs ~1000 requests (50 s) on average; 90 s leaves 5 sd of room, and ends the last step. A step
# advances once a 0.8-sd regression is excluded (~40 canary outcomes at 5%), so the A/A ramps walk every step.
# With min_samples=50 the latency guardrail judges the canary's p99 from 50 outcomes on (their maximum).
AA_CFG = CanaryConfig(min_samples=50, max_step_s=90.0, detect_regression_sd=0.8)
AA_RAMPS = 200


@pytest.fixture(scope="module")
def aa() -> list[RampResult]:
    return ramps(AA_CFG, BASE, range(AA_RAMPS), look_every=100)


def count(results: list[RampResult]) -> Counter[str]:
    return Counter(r.action for r in results)


def test_aa_false_rollback_rate_within_alpha(aa: list[RampResult]) -> None:
    n = count(aa)
    assert n["rollback"] <= AA_CFG.alpha * AA_RAMPS, n


def test_aa_false_promotion_rate_within_alpha(aa: list[RampResult]) -> None:
    n = count(aa)
    assert n["promote"] <= AA_CFG.alpha * AA_RAMPS, n


def test_aa_false_alarms_together_within_alpha(aa: list[RampResult]) -> None:
    """The union bound of the design: primary at alpha/2 plus three guardrails at alpha/6 each spend at most alpha."""
    n = count(aa)
    assert n["rollback"] + n["promote"] <= AA_CFG.alpha * AA_RAMPS, n


def test_aa_ramps_end_inconclusive_after_walking_every_step_otherwise(aa: list[RampResult]) -> None:
    """Counted apart from the false alarms: no decision at the last step within max_step_s."""
    n = count(aa)
    assert set(n) <= {"rollback", "promote", "inconclusive"}, n  # none 'unfinished': the policy ended each ramp
    assert all(r.step == len(AA_CFG.steps) - 1 for r in aa if r.action == "inconclusive")
    assert n["inconclusive"] > 0.75 * AA_RAMPS, n


# --- A/A on users who differ: sticky arms cluster outcomes by user; strata and CUPED adjust -------------

HETERO = Population(user_spread=0.5, kinds=(("line_start", 0.5, 0.5), ("mid_line", 0.5, 1.5)), history_requests=18.0)


def test_aa_false_alarms_within_alpha_with_strata_cuped_and_clustered_users() -> None:
    """4,000 users, each accepting at its own rate (x Gamma(cv 0.5)) and sticking to its arm, two request kinds,
    18 outcomes each before the ramp: the adjusted test still spends at most alpha."""
    results = [
        run_ramp(AA_CFG, (BASE, BASE), seed, RATE_RPS, 100, 10**6, users=4000, population=HETERO) for seed in range(AA_RAMPS)
    ]
    n = count(results)
    assert n["rollback"] + n["promote"] <= AA_CFG.alpha * AA_RAMPS, n
    assert n["inconclusive"] > 0.75 * AA_RAMPS, n


def test_strata_and_cuped_narrow_the_interval_on_users_who_differ() -> None:
    outs = sample((BASE, BASE), 0.5, 20_000, 3, users=4000, population=HETERO)
    cfg = CanaryConfig()
    half = {}
    for adjust in (False, True):
        c = cfg.model_copy(update={"stratify": adjust, "cuped": adjust})
        r = look(c, 2, outs, 0, 0.0, {}).comparisons["reward"]
        half[adjust] = r.high - r.delta
    assert half[True] ** 2 < 0.85 * half[False] ** 2, half  # ~0.77 of the variance (bench/canary.py variance_ratio)
    assert {o.kind for o in outs} == {"line_start", "mid_line"} and any(o.history for o in outs)


# --- a degraded canary: accept rate 0.3 -> 0.12 (-60%) ------------------------------------------


def test_degraded_canary_is_rolled_back_at_the_first_step() -> None:
    """'Exposed' = canary requests / all requests until the decision. Users are assigned at random, so that
    share of n requests scatters around the weight by sqrt(w (1 - w) / n); a rollback within step 0
    holds the routed share at 5%, and the realised share may exceed it only by that noise (3 sd)."""
    cfg = CanaryConfig()  # production steps and min_samples
    w = cfg.steps[0]
    results = ramps(cfg, ArmModel(accept_p=0.12), range(50), look_every=50)
    stopped = [
        r
        for r in results
        if r.action == "rollback" and r.step == 0 and r.exposed_share <= w + 3 * math.sqrt(w * (1 - w) / r.requests)
    ]
    assert len(stopped) >= 0.95 * len(results), [(r.action, r.step, round(r.exposed_share, 3)) for r in results]
    pooled = sum(r.canary_requests for r in results) / sum(r.requests for r in results)
    assert pooled <= w + 0.01, pooled


# --- a better canary: accept rate 0.3 -> 0.4 ------------------------------------------------------


def test_better_canary_is_promoted_through_every_step() -> None:
    cfg = CanaryConfig(min_samples=100, max_step_s=300.0)
    results = ramps(cfg, ArmModel(accept_p=0.4), range(50), look_every=100)
    promoted = [r for r in results if r.action == "promote" and r.step == len(cfg.steps) - 1]
    assert len(promoted) >= 0.8 * len(results), Counter((r.action, r.step, r.reason[:24]) for r in results)
    assert all("reward rose" in r.reason for r in promoted)


# --- better on reward, worse on accepted characters: never promoted ---------------------------------------


def test_a_canary_better_on_reward_but_worse_on_accepted_chars_is_never_promoted() -> None:
    """10% more accepts (reward +0.03 per request) of suggestions 27% shorter: accepted characters per request
    fall 20%. The reward test alone would promote it; the guardrail's non-inferiority requirement never lets it, and
    the first step, which must exclude a regression of accepted characters as well as of reward, holds it at 5%
    until the guardrail rolls it back or the step runs out of time (inconclusive: rolled back by default)."""
    cfg = CanaryConfig(max_step_s=600.0)
    results = ramps(cfg, ArmModel(0.33, mean_chars=17.45), range(20), look_every=100)
    assert not any(r.action == "promote" for r in results), Counter((r.action, r.reason[:30]) for r in results)
    assert all(r.step == 0 for r in results), Counter((r.action, r.step) for r in results)
    for r in results:
        assert (
            "accepted chars per request fell" in r.reason
            if r.action == "rollback"
            else (r.action == "inconclusive" and "step regression not excluded at risk 0.2: accepted_chars delta" in r.reason)
        ), r.reason
    assert np.mean([r.deltas["reward"] for r in results]) > 0 > np.mean([r.deltas["accepted_chars"] for r in results])


# --- a canary that has learned silence: the collapse the accepted-characters guardrail exists for ----------


def test_silent_canary_with_higher_reward_is_rolled_back_by_the_accepted_chars_guardrail() -> None:
    """A policy that abstains on 70% of requests and shows short, safe suggestions otherwise: fewer suggestions,
    a higher accept rate, a *higher* reward per request under the default rule (abstaining earns 0, a rejection
    -0.25), and far fewer accepted characters. Reward alone would promote it; the guardrail rolls it back."""
    cfg = CanaryConfig()  # production steps, min_samples and test sizes
    silent = ArmModel(accept_p=0.6, mean_chars=10.0, show_p=0.3)
    results = ramps(cfg, silent, range(30), look_every=50)
    assert all(r.action == "rollback" and "accepted chars per request fell" in r.reason for r in results), Counter(
        (r.action, r.step, r.reason[:30]) for r in results
    )
    assert sum(r.step == 0 for r in results) >= 0.9 * len(results)  # caught at 5%
    mean = {m: float(np.mean([r.deltas[m] for r in results])) for m in ("reward", "accepted_chars")}
    # what the arms served until the rollback (canary − control): the reward rose, the value delivered fell
    assert mean["reward"] > 0 and mean["accepted_chars"] < 0, mean


def test_silent_arm_shows_nothing_on_its_share_of_requests() -> None:
    arms = (BASE, ArmModel(0.6, mean_chars=10.0, show_p=0.3))
    users = np.random.default_rng(1).random(10_000)
    outs, canary, _ = _serve(np.random.default_rng(0), arms, RewardRule(), users, 0.5, 0, 6000, RATE_RPS)
    silent = [o for o in outs if o.arm == "canary" and o.reward == 0.0]
    share = len(silent) / sum(o.arm == "canary" for o in outs)
    assert abs(share - 0.7) < 0.03, share  # empty completions: the rule's `empty` reward, nothing accepted
    assert all(o.accepted == 0.0 and o.accepted_chars == 0.0 for o in silent)
    assert not any(o.reward == 0.0 for o in outs if o.arm == "control")
    shown = {a: [o for o in outs if o.arm == a and o.reward != 0.0] for a in ("control", "canary")}
    rate = {a: sum(o.accepted for o in v) / len(v) for a, v in shown.items()}  # accept rate per suggestion shown
    assert rate["canary"] > rate["control"] + 0.2, rate
    with pytest.raises(ValueError, match="show_p"):
        ArmModel(0.3, show_p=0.0)
