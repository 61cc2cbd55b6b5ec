"""Held-out evaluation: intervals, users' verdicts turned into the flywheel's metrics, the truncation baseline."""

from __future__ import annotations

import math
import random

import pytest

from data_contracts.rewards import RewardRule
from sim.evaluate import EvalCase, best_truncation, mean_ci, ratio_ci, score
from sim.tab_sites import TabSite


def case(intended: str, min_chars: int = 3) -> EvalCase:
    return EvalCase(TabSite("f.py", 0, "x = ", intended), min_chars, 0)


def test_mean_interval_covers_the_truth_at_about_95_percent():
    rng, hits = random.Random(0), 0
    for _ in range(400):
        e = mean_ci([rng.gauss(1.0, 2.0) for _ in range(200)])
        hits += e.low <= 1.0 <= e.high
    assert 0.92 <= hits / 400 <= 0.98


def test_ratio_interval_is_the_ratio_of_sums():
    e = ratio_ci([1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 1, 1])
    assert e.mean == pytest.approx(3 / 5) and e.low < 0.6 < e.high
    assert math.isnan(ratio_ci([0, 0], [0, 0]).mean)


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
