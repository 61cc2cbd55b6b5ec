"""Paired comparisons of versions on the same held-out requests (sim/paired.py), the claim line built on them,
the learning report, and `tidal eval --code-dir`'s sites."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sim.evaluate import Outcomes, eval_cases, proportion_ci
from sim.learning_report import LearningReport, learning_report
from sim.paired import claim_line, compare
from sim.users import SimUsersConfig


def version(
    rng: np.random.Generator, n: int, p_shown: float, p_accept: float, base: Outcomes | None = None, flip: float = 0.0
) -> Outcomes:
    """Simulated per-request outcomes; with `base`, the same requests with a share `flip` of its rejections turned
    into accepts (what a better version does on the same sites)."""
    if base is None:
        shown = (rng.random(n) < p_shown).astype(float)
        accepted = shown * (rng.random(n) < p_accept)
    else:
        shown, accepted = base.shown.copy(), base.accepted.copy()
        accepted[(shown == 1) & (accepted == 0) & (rng.random(n) < flip)] = 1.0
    kept = accepted * 5.0
    reward = np.where(accepted == 1, 0.75, np.where(shown == 1, -0.25, 0.0))
    return Outcomes(shown, accepted, kept, reward)


def test_the_same_version_against_itself_moves_nothing():
    a = version(np.random.default_rng(0), 500, 0.9, 0.2)
    cmp = compare(a, a)
    for c in cmp.values():
        assert c.delta.mean == c.delta.low == c.delta.high == 0 and not c.significant
    assert cmp["accept_rate"].ratio.mean == pytest.approx(1.0) and cmp["reward_per_request"].ratio is None


def test_a_better_version_on_the_same_requests_is_significant_with_a_narrower_interval_than_unpaired():
    rng = np.random.default_rng(1)
    a = version(rng, 3000, 0.95, 0.05)
    b = version(rng, 3000, 0, 0, base=a, flip=0.05)  # ~+4.75 points of accepts per suggestion, same sites
    cmp = compare(a, b)
    acc = cmp["accept_rate"]
    assert acc.significant and acc.delta.low > 0
    true_ratio = b.accepted.sum() / a.accepted.sum()  # the same suggestions shown on both sides
    assert acc.ratio.low < true_ratio < acc.ratio.high
    # Two independent Wilson intervals side by side are far wider than the paired interval of the difference.
    ia = proportion_ci(int(a.accepted.sum()), int(a.shown.sum()))
    ib = proportion_ci(int(b.accepted.sum()), int(b.shown.sum()))
    unpaired = ((ia.high - ia.low) ** 2 + (ib.high - ib.low) ** 2) ** 0.5
    assert (acc.delta.high - acc.delta.low) < 0.75 * unpaired
    assert not cmp["suggestion_rate"].significant  # suggestions unchanged


def test_the_paired_interval_covers_the_true_difference_about_95_percent_of_the_time():
    """200 replays of 400 requests where b accepts each rejected suggestion with probability 2%: the interval of the
    accept-rate difference holds its expectation (2% of the rejections) in ~95% of the replays."""
    rng, hits = np.random.default_rng(2), 0
    p_shown, p_accept, flip = 0.9, 0.1, 0.02
    truth = (1 - p_accept) * flip  # expected rise in accepts per suggestion
    for trial in range(200):
        a = version(rng, 400, p_shown, p_accept)
        b = version(rng, 400, 0, 0, base=a, flip=flip)
        d = compare(a, b, resamples=400, seed=trial)["accept_rate"].delta
        hits += d.low <= truth <= d.high
    assert 0.88 <= hits / 200 <= 0.995, hits


def test_the_claim_names_only_significant_moves_and_never_a_ratio_of_a_negative_reward():
    rng = np.random.default_rng(3)
    a = version(rng, 3000, 0.95, 0.01)
    b = version(rng, 3000, 0, 0, base=a, flip=0.03)  # accepts ×~4, reward up, suggestions unchanged
    cmp = compare(a, b)
    assert a.reward.mean() < 0 and b.reward.mean() > a.reward.mean()
    line = claim_line(cmp, "v1", "v2", 3000)
    claimed, _, flat = line.partition("not significant:")
    assert "accept_rate ×" in claimed and "reward_per_request +" in claimed  # a difference, with its sign
    assert "reward_per_request ×" not in line and not re.search(r"[+-]\d+%", line)  # no relative change of a mean < 0
    assert "suggestion_rate" in flat and "suggestion_rate" not in claimed
    assert claim_line(compare(a, a), "v1", "v1", 3000).startswith(
        "learning claim (v1 against v1, 3000 paired held-out requests, 95% intervals): no significant change"
    )


def test_mismatched_replays_are_refused():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="same non-empty requests"):
        compare(version(rng, 10, 0.9, 0.1), version(rng, 11, 0.9, 0.1))


def test_the_learning_report_holds_ratios_intervals_and_the_truncation_verdict():
    rng = np.random.default_rng(5)
    a = version(rng, 2000, 0.95, 0.02)
    b = version(rng, 2000, 0, 0, base=a, flip=0.04)
    cut = Outcomes(a.shown, a.accepted, a.kept, np.zeros(len(a)))  # a baseline whose reward is 0 everywhere
    report = learning_report(
        compare(a, b), compare(cut, b), final_version=3, requests=2000, promoted=1, total_s=12.34, train_s=5.0
    )
    assert report.accept_ratio > 1 and report.accept_ratio_ci[0] <= report.accept_ratio <= report.accept_ratio_ci[1]
    assert report.reward_delta > 0 and report.reward_delta_ci[0] > 0
    assert report.beats_truncation == (report.chars_vs_truncation >= 0 and report.reward_vs_truncation >= 0)
    assert LearningReport.model_validate_json(report.model_dump_json()) == report  # the stored form reads back
    # version 1 with no accepts among a few requests: no ratio exists, and the report says so with None
    none = Outcomes(a.shown[:20], np.zeros(20), np.zeros(20), a.reward[:20])
    small = learning_report(compare(none, none), compare(none, none), 1, 20, 0, 1.0, 0.0)
    assert small.accept_ratio is None and small.chars_ratio is None and small.suggestion_ratio == pytest.approx(1.0)


def test_code_dir_draws_every_site_from_the_given_code(tmp_path):
    (tmp_path / "mine.py").write_text("def add_numbers(first, second):\n    return first + second\n" * 20)
    cases = eval_cases(SimUsersConfig(), 0.1, 30, seed=1, code_dir=tmp_path)
    assert len(cases) == 30 and {c.site.file for c in cases} == {"mine.py"}
    with pytest.raises(FileNotFoundError, match="--code-dir .* is not a directory"):
        eval_cases(SimUsersConfig(), 0.1, 5, seed=1, code_dir=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no \\*.py files"):
        eval_cases(SimUsersConfig(), 0.1, 5, seed=1, code_dir=tmp_path / "empty")


def test_tidal_eval_takes_a_code_dir():
    from tidal.cli import build_parser

    args = build_parser().parse_args(["eval", "tab", "--versions", "1,4", "--code-dir", "src"])
    assert args.code_dir == "src" and args.versions == "1,4"
