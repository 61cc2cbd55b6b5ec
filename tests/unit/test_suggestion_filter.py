"""The suggestion filter: its fit on logged verdicts, the candidate's first-token scores, its lineage tag, and the
collection that never trains on a withheld completion (the gateway's side: tests/unit/test_gateway_parts.py)."""

from __future__ import annotations

import numpy as np
import pytest

from data_contracts.suggestion_filter import SuggestionFilter, describe, fit_filter, from_tags
from tests.unit.test_collect import collect
from tests.unit.test_contracts_data import T0, completion, feedback, put_logs
from tidal.store import LocalStore

HOUR = 3_600_000


def _logged(n_rejected: int, kept: dict[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Rejected rows at log-probs -9..-1 spread evenly, plus one row per (log-prob: kept characters)."""
    lp = np.concatenate([np.linspace(-9, -1, n_rejected), list(kept)])
    return lp, np.concatenate([np.zeros(n_rejected), list(kept.values())])


def test_the_threshold_withholds_the_unlikely_rejections_up_to_the_kept_characters_budget():
    # 100 rejections at -9..-1, kept characters at -4 (10 chars) and at -0.5 (90 chars): withholding the row at -4
    # would lose 10% of the kept characters, so the threshold stops just above the rejections below it
    lp, kept = _logged(100, {-4.0: 10.0, -0.5: 90.0})
    f = fit_filter(lp, kept, max_chars_loss=0.03, max_withheld=0.9, min_kept_rows=2)
    assert f.min_first_logprob == pytest.approx(-4.0)
    assert f.kept_chars_share == 1.0 and "kept-characters loss" in f.reason
    assert f.withheld_share == pytest.approx((lp < -4.0).mean())
    # a budget of 15% lets it past that row, up to the withheld-share cap
    g = fit_filter(lp, kept, max_chars_loss=0.15, max_withheld=0.8, min_kept_rows=2)
    assert g.min_first_logprob > -4.0 and g.kept_chars_share == pytest.approx(0.9) and "withheld share" in g.reason
    assert g.withheld_share <= 0.8 and g.withholds([g.min_first_logprob - 1e-6]) and not g.withholds([g.min_first_logprob])


def test_too_little_evidence_or_a_kept_row_at_the_bottom_fits_no_threshold_and_says_why():
    lp, kept = _logged(50, {-2.0: 5.0})
    none = fit_filter(lp, kept, 0.03, 0.4, min_kept_rows=2)
    assert none.min_first_logprob is None and "1 logged completions kept characters, 2 needed" in none.reason
    assert not none.withholds([-100.0]) and "no suggestion filter" in describe(none)
    lp, kept = _logged(50, {-20.0: 5.0, -0.5: 5.0})  # the least likely row was kept: nothing can be withheld
    bottom = fit_filter(lp, kept, 0.03, 0.4, min_kept_rows=2)
    assert bottom.min_first_logprob is None and bottom.withheld_share == 0.0
    assert not SuggestionFilter.model_validate_json(bottom.model_dump_json()).withholds([-30.0, 0.0])


def test_equal_log_probs_are_withheld_together_and_bad_input_is_refused():
    lp = np.array([-5.0, -5.0, -5.0, -1.0, -0.5])
    f = fit_filter(lp, np.array([0, 0, 0, 0, 3.0]), 0.0, 0.5, 1)  # a cut between the ties would withhold 1 or 2 of 3
    assert f.min_first_logprob is None and f.withheld_share == 0.0  # all three is 60% > the 50% cap
    g = fit_filter(lp, np.array([0, 0, 0, 0, 3.0]), 0.0, 0.9, 1)
    assert g.min_first_logprob == -0.5 and g.withheld_share == pytest.approx(0.8)
    with pytest.raises(ValueError, match="expected \\(N,\\) arrays"):
        fit_filter(lp, np.zeros(3), 0.03, 0.4, 1)
    with pytest.raises(ValueError, match="NaN/inf"):
        fit_filter(np.array([np.nan, -1.0]), np.zeros(2), 0.03, 0.4, 1)


def test_completions_a_parent_withheld_are_measured_not_assumed_withheld():
    # 60 shown rejections at -9..-1 and kept rows at -0.5; the parent withheld 40 more requests. Counted as
    # withheld by the candidate too (a dataset that predates the withheld file), they fill the 40% cap at once.
    # Scored, a sharper candidate's first tokens on 30 of those 40 are likely (-0.2): it would show them, and the
    # cap leaves room to withhold the unlikely shown rejections.
    lp, kept = _logged(60, {-0.5: 50.0, -0.4: 50.0})
    assumed = fit_filter(lp, kept, 0.03, 0.4, 2, already_withheld=40)
    every = np.concatenate([lp, [-6.0] * 10 + [-0.2] * 30])
    measured = fit_filter(every, np.concatenate([kept, np.zeros(40)]), 0.03, 0.4, 2, withheld_rows=40)
    assert assumed.min_first_logprob == pytest.approx(-9.0) and assumed.withheld_share == pytest.approx(40 / 102)
    # 40 of the 102 requests withheld: the 10 unlikely withheld ones and the 30 least likely shown rejections
    assert (every < measured.min_first_logprob).sum() == 40 and measured.withheld_share == pytest.approx(40 / 102)
    assert measured.min_first_logprob > -6.0 and measured.withheld_rows == 40
    assert measured.fitted_rows == 102 and "(40 withheld by their versions)" in describe(measured)


def test_the_gate_registers_the_filter_as_a_lineage_tag_the_fleet_reads_back():
    from training.job_spec import GateReport

    f = fit_filter(*_logged(100, {-4.0: 10.0, -0.5: 90.0}), 0.03, 0.9, 2)
    tags = GateReport(passed=True, checks=[], figures={}, suggestion_filter=f).tags()
    assert from_tags(tags) == f and from_tags(GateReport(passed=True, checks=[], figures={}).tags()) is None
    assert "withholds suggestions whose first token has log-prob < -4.000" in describe(f)


def test_the_candidate_scores_each_logged_first_token_as_the_engine_sampled_it(champion_dir, samples):
    """The rows' prompts differ in length (right padding); each first token's log-prob equals the behaviour log-prob
    the champion logged when it sampled it, teacher-forced one row at a time."""
    from training.policy import load_policy
    from training.suggestion_filter import first_token_logprobs, judged_rows

    rows = samples[:20]
    assert len({len(s.prompt_token_ids) for s in rows}) > 5
    lp = first_token_logprobs(load_policy(champion_dir), rows, pad_id=0, batch=8)
    assert lp == pytest.approx([s.behaviour_logprobs[0] for s in rows], abs=1e-4)
    unjudged = [rows[0].model_copy(update={"event": "none"}), rows[1].model_copy(update={"completion_text": ""})]
    assert judged_rows(unjudged + rows[2:4]) == rows[2:4]


def test_the_logging_version_fits_its_own_filter_with_unit_weights(champion_dir, samples):
    """pi/mu of the first token is 1 when the candidate is the version that logged the rows: the weighted fit is the
    plain one."""
    from training.policy import load_policy
    from training.suggestion_filter import fit_for, judged_rows
    from training.train_settings import SuggestionFilterSettings

    cfg = SuggestionFilterSettings(enabled=True, max_chars_loss=0.1, max_withheld=0.5, min_kept_rows=3)
    rows = judged_rows(samples)
    kept = np.array([1.0 if s.event == "accepted" else 0.0 for s in rows])
    plain = fit_filter(np.array([s.behaviour_logprobs[0] for s in rows]), kept, 0.1, 0.5, 3)
    fitted = fit_for(load_policy(champion_dir), samples, 0, cfg)
    assert plain.min_first_logprob is not None and fitted.fitted_rows == len(rows) == len(samples)
    assert fitted.min_first_logprob == pytest.approx(plain.min_first_logprob, abs=1e-4)
    assert fitted.withheld_share == pytest.approx(plain.withheld_share, abs=1e-3)


def test_the_candidate_scores_the_completions_the_dataset_kept_as_withheld(champion_dir, samples):
    """Withheld completions join the fit with no kept characters (the logging version scores them as it sampled them:
    unit weights); a dataset that predates the withheld file falls back to their count."""
    from dataclasses import replace

    from data_contracts.samples import WithheldSample
    from training.policy import load_policy
    from training.reward_data import RewardDataset
    from training.suggestion_filter import fit_for, judged_rows
    from training.train_settings import SuggestionFilterSettings

    cfg = SuggestionFilterSettings(enabled=True, max_chars_loss=0.1, max_withheld=0.5, min_kept_rows=3)
    rows = judged_rows(samples)
    shown, held = rows[12:], [WithheldSample.model_validate(s.model_dump()) for s in rows[:12]]
    data = RewardDataset("ds", "sha256:0", "r@1", shown, None, {1: 12}, held)
    policy = load_policy(champion_dir)
    lp = np.array([s.behaviour_logprobs[0] for s in [*shown, *held]])
    kept = np.array([1.0 if s.event == "accepted" else 0.0 for s in shown] + [0.0] * 12)
    fitted, plain = fit_for(policy, shown, 0, cfg, data), fit_filter(lp, kept, 0.1, 0.5, 3, withheld_rows=12)
    assert fitted.withheld_rows == 12 and fitted.fitted_rows == len(rows)
    assert fitted.min_first_logprob == pytest.approx(plain.min_first_logprob, abs=1e-4)
    assert fitted.withheld_share == pytest.approx(plain.withheld_share, abs=1e-3)
    old = fit_for(policy, shown, 0, cfg, replace(data, withheld_samples=None))
    counted = fit_filter(lp[: len(shown)], kept[: len(shown)], 0.1, 0.5, 3, already_withheld=12)
    assert old.withheld_rows == 0 and old.fitted_rows == len(shown)
    assert old.withheld_share == pytest.approx(counted.withheld_share, abs=1e-3)


def test_a_withheld_completion_is_counted_and_never_becomes_a_training_row(tmp_path):
    store = LocalStore(tmp_path)
    shown = completion(T0 + 60_000, 0)
    withheld = completion(T0 + 61_000, 1) | {"completion_text": "", "finish_reason": "withheld"}
    put_logs(store, "completions", [shown, withheld])
    put_logs(store, "feedback", [feedback(shown, "accepted")])
    result = collect(store, T0 + HOUR + 20 * 60_000)
    counts = result.manifest.stored()["counts"]["completions"]
    assert counts["filtered_by_reason"] == {"withheld": 1} and counts["kept"] == 1
    assert result.samples["request_id"].to_pylist() == [shown["request_id"]]
    assert result.manifest.withheld_by_version == {1: 1}
    # ... and is kept beside the dataset, for the next candidate's filter to score
    from training.reward_data import load_dataset

    data = load_dataset(store, "tab", result.manifest.dataset_id)
    assert result.manifest.withheld_rows == 1 and [w.request_id for w in data.withheld_samples] == [withheld["request_id"]]
    assert data.withheld_samples[0].completion_token_ids == withheld["completion_token_ids"]


def test_a_versions_served_figures_count_its_withheld_requests_as_answered_with_nothing(samples):
    """The cycle table's figures of a filtered version: its withheld requests are requests with no suggestion shown
    (the rule's empty reward), though the dataset holds no row of them."""
    from tasks.flywheel import served_metrics

    rows = samples[:10]
    plain, filtered = served_metrics(rows)[1], served_metrics(rows, {1: 10}, empty_reward=0.5)[1]
    assert filtered["requests"] == 20 and filtered["suggestion_rate"] == pytest.approx(plain["suggestion_rate"] / 2)
    assert filtered["accept_rate"] == plain["accept_rate"]
    assert filtered["reward_per_request"] == pytest.approx((plain["reward_per_request"] * 10 + 5.0) / 20)
    assert served_metrics(rows, {2: 3})[2] == {
        "requests": 3.0,
        "suggestion_rate": 0.0,
        "accept_rate": 0.0,
        "reward_per_request": 0.0,
        "accepted_chars_per_request": 0.0,
    }


def test_weights_measure_the_shares_on_the_versions_own_first_tokens():
    """A sharper candidate rarely draws the unlikely first tokens the champion logged: weighted by pi/mu, the rows
    below a threshold are a smaller share of what it will serve, so the same cap lets the threshold rise."""
    lp, kept = _logged(100, {-0.5: 90.0, -0.2: 10.0})
    plain = fit_filter(lp, kept, 0.03, 0.3, min_kept_rows=2)
    weights = np.where(lp < -5, 0.1, 1.0)  # the candidate draws the rows below -5 a tenth as often
    weighted = fit_filter(lp, kept, 0.03, 0.3, min_kept_rows=2, weights=weights)
    assert weighted.min_first_logprob > plain.min_first_logprob
    below = lp < weighted.min_first_logprob
    assert weighted.withheld_share == pytest.approx(weights[below].sum() / weights.sum()) and weighted.withheld_share <= 0.3
    assert (below.mean() > 0.3) and "withheld share" in weighted.reason
    with pytest.raises(ValueError, match="negative weight"):
        fit_filter(lp, kept, 0.03, 0.3, 2, weights=-weights)


def test_requests_the_logging_version_withheld_count_against_the_cap_so_filters_do_not_stack():
    """A candidate trained on a filtered champion's logs sees only what was shown: its cap is of every request, those
    its parent withheld included. With the cap already reached it withholds no shown row, but still everything below
    the least likely one shown (where its parent's withheld requests lie)."""
    lp, kept = _logged(100, {-0.5: 90.0, -0.2: 10.0})
    fresh = fit_filter(lp, kept, 0.03, 0.4, min_kept_rows=2)
    after = fit_filter(lp, kept, 0.03, 0.4, min_kept_rows=2, already_withheld=25)  # a fifth of 127 requests withheld
    assert fresh.withheld_share == pytest.approx(0.4, abs=0.01) and after.withheld_share == pytest.approx(0.4, abs=0.01)
    assert after.min_first_logprob < fresh.min_first_logprob  # fewer shown rows left to withhold
    assert (lp < after.min_first_logprob).sum() == pytest.approx(0.4 * 127 - 25, abs=1)
    capped = fit_filter(lp, kept, 0.03, 0.4, min_kept_rows=2, already_withheld=100)  # 49% withheld already
    assert capped.min_first_logprob == lp.min() and capped.withheld_share == pytest.approx(100 / 202)
    assert not capped.withholds([lp.min()]) and capped.withholds([lp.min() - 0.1])
