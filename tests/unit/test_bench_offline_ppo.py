"""bench/offline_ppo.py: its last line, the learning report of a trained policy against its checkpoint, and the
completions as served under a suggestion filter budget."""

from __future__ import annotations

import json

from bench.offline_ppo import filtered, final_report
from data_contracts.rewards import RewardRule
from sim.evaluate import best_truncation, eval_cases
from sim.learning_report import LearningReport
from sim.users import SimUsersConfig

REPORT_KEYS = {
    "accept_ratio",
    "accept_ratio_ci",
    "suggestion_ratio",
    "chars_ratio",
    "chars_ratio_ci",
    "reward_delta",
    "reward_delta_ci",
    "beats_truncation",
    "promoted",
    "final_version",
    "requests_per_version",
    "total_s",
    "train_s",
}


def test_final_report_pairs_the_trained_policy_with_the_checkpoint_and_its_truncation() -> None:
    cases = eval_cases(SimUsersConfig(), 0.1, 200, seed=5)
    rule = RewardRule()
    # the checkpoint suggests the rest of the line with a wrong tail; cutting it keeps the right start
    base = [c.site.intended[:4] + "#wrong" for c in cases]
    same = json.loads(final_report(cases, rule, base, base, 2, 10.0, 4.0).model_dump_json())
    assert REPORT_KEYS <= set(same) and same["final_version"] == 2 and same["requests_per_version"] == 200
    assert same["accept_ratio"] is None  # no accept to compare against: v1 scored 0
    assert same["reward_delta"] == 0.0 and same["reward_delta_ci"] == [0.0, 0.0] and same["promoted"] is None
    # cut to 4 characters, a partial (0.75 x 4/10 of the reward) becomes an accept: the truncation baseline wins
    assert not same["beats_truncation"] and same["reward_vs_truncation"] < 0

    k, _ = best_truncation(cases, base, rule)
    cut = LearningReport.model_validate(final_report(cases, rule, base, [t[:k] for t in base], 2, 10.0, 4.0).model_dump())
    assert cut.chars_vs_truncation == 0.0 and cut.reward_vs_truncation == 0.0 and cut.beats_truncation
    assert cut.reward_delta > 0 and cut.reward_delta_ci[0] > 0  # partials became accepts on the same requests
    assert (cut.total_s, cut.train_s) == (10.0, 4.0)


def test_learning_study_configurations_are_valid_settings() -> None:
    """Every configuration of bench/learning_study.py is a valid PPO config and reward rule (a typo fails here,
    not an hour into a study)."""
    from bench.learning_study import CONFIGS, STUDY_BASE
    from tidal.loop_settings import DemoSettings

    demo = DemoSettings()
    for name, (ppo, rule) in CONFIGS.items():
        cfg = type(demo.train.ppo).model_validate({**demo.train.ppo.model_dump(), **STUDY_BASE, **ppo})
        assert all(getattr(cfg, k) == v for k, v in ppo.items()), name
        RewardRule.model_validate({**RewardRule().model_dump(), **rule})
    # The demo runs the study's best configuration (docs/learning.md, item 26).
    best = {**STUDY_BASE, **CONFIGS["full_norm1e2_stop2_budget25_kept4_t05"][0]}
    assert all(getattr(demo.train.ppo, k) == v for k, v in best.items() if k != "passes"), demo.train.ppo


def test_a_filter_budget_withholds_only_shown_completions_below_its_threshold() -> None:
    texts, first = ["ab", "", "cd", "ef"], [-3.0, -9.0, -0.5, -2.0]
    assert filtered(texts, first, None) == texts  # no filter fitted: everything is shown
    assert filtered(texts, first, -2.0) == ["", "", "cd", "ef"]  # strictly below the threshold is withheld
    assert filtered(texts, first, -0.1) == ["", "", "", ""]
