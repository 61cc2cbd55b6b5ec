"""Held-out evaluation: intervals, users' verdicts turned into the flywheel's metrics, the truncation baseline."""

from __future__ import annotations

import math
import random

import pytest

from data_contracts.rewards import RewardRule
from sim.evaluate import EvalCase, best_truncation, mean_ci, proportion_ci, score
from sim.tab_sites import TabSite


def case(intended: str, min_chars: int = 3) -> EvalCase:
    return EvalCase(TabSite("f.py", 0, "x = ", intended), min_chars, 0)


def test_mean_interval_covers_the_truth_at_about_95_percent():
    rng, hits = random.Random(0), 0
    for _ in range(400):
        e = mean_ci([rng.gauss(1.0, 2.0) for _ in range(200)])
        hits += e.low <= 1.0 <= e.high
    assert 0.92 <= hits / 400 <= 0.98


def test_proportion_interval_is_wilsons():
    e = proportion_ci(3, 5)
    # Wilson's 95% interval for 3 of 5 (Agresti & Coull 1998, table 1 form): [0.231, 0.882]
    assert e.mean == pytest.approx(0.6) and e.low == pytest.approx(0.2307, abs=1e-3) and e.high == pytest.approx(0.8824, abs=1e-3)
    assert math.isnan(proportion_ci(0, 0).mean)


def test_no_accepts_still_bound_the_rate_above_zero():
    # A normal interval would be [0, 0]; 0 of 600 rules out only rates above ~0.64%.
    e = proportion_ci(0, 600)
    assert e.mean == 0 and e.low == pytest.approx(0, abs=1e-12) and e.high == pytest.approx(0.00636, abs=2e-4)
    full = proportion_ci(600, 600)
    assert full.high == pytest.approx(1) and full.low == pytest.approx(1 - 0.00636, abs=2e-4)


def test_proportion_interval_covers_the_truth_at_about_95_percent():
    rng, hits = random.Random(1), 0
    for _ in range(400):
        e = proportion_ci(sum(rng.random() < 0.02 for _ in range(600)), 600)
        hits += e.low <= 0.02 <= e.high
    assert 0.92 <= hits / 400 <= 0.99


def test_score_applies_the_verdict_and_the_reward_rule():
    rule = RewardRule()
    cases = [case("return x"), case("return x"), case("pass"), case("foo()")]
    texts = ["return", "", "pa", "bar"]  # accepted (6), nothing shown, too short → rejected, rejected
    m = score(cases, texts, rule)
    assert m["suggestion_rate"].mean == pytest.approx(3 / 4)
    assert m["accept_rate"].mean == pytest.approx(1 / 3)
    assert m["accepted_chars_per_request"].mean == pytest.approx(6 / 4)
    assert m["reward_per_request"].mean == pytest.approx((0.75 + 0 - 0.25 - 0.25) / 4)


def test_truncation_baseline_picks_the_best_cut():
    cases = [case("return value"), case("self.items")]
    texts = ["return vXXXX", "self.iteZZ"]  # cut to 8 chars: both accepted
    k, m = best_truncation(cases, texts, RewardRule())
    assert k == 8 and m["accept_rate"].mean == 1.0
