"""Reward rules: each event, partial scaling, empty completions, no-feedback policies, the rule recorded."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from data_contracts.collect_settings import CollectSettings
from data_contracts.rewards import RewardRule, kept_chars
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, T0, FixedVersions, completion, feedback, put_logs
from tidal.store import LocalStore

TEXT = "x" * 16


def test_each_event():
    rule = RewardRule()
    assert rule.reward("accepted", None, TEXT) == 0.75
    assert rule.reward("rejected", None, TEXT) == -0.25
    assert rule.reward("none", None, TEXT) == 0.0  # ignored
    assert RewardRule(ignored=-0.05).reward("none", None, TEXT) == -0.05


def test_partial_scales_with_the_share_of_characters_kept():
    rule = RewardRule()
    assert rule.reward("partial", 4, TEXT) == pytest.approx(0.75 * 4 / 16)
    assert rule.reward("partial", 0, TEXT) == 0.0
    assert rule.reward("partial", 99, TEXT) == 0.75  # never more than was shown


def test_characters_kept_are_read_from_a_verdict_one_way():
    events = np.array(["accepted", "accepted", "partial", "partial", "rejected", "none"], dtype=object)
    chars = np.array([np.nan, 3, 4, np.nan, 5, np.nan])
    shown = np.array([10, 10, 10, 10, 10, 10])
    # an accept without a count kept everything; a partial its count; a reject or silence nothing; never past shown
    assert kept_chars(events, chars, shown).tolist() == [10, 3, 4, 0, 0, 0]
    assert kept_chars(np.array(["partial"], dtype=object), np.array([15.0]), np.array([10])).tolist() == [10]


def test_empty_completion_earns_the_empty_reward_whatever_the_feedback():
    rule = RewardRule(empty=0.01)
    assert [rule.reward(e, None, "") for e in ("accepted", "rejected", "none")] == [0.01, 0.01, 0.01]


def test_scaling_by_characters_values_what_the_user_keeps():
    rule = RewardRule(accept_scale_by_chars=True, accept_chars_cap=8)
    assert rule.reward("accepted", None, "abcd") == pytest.approx(0.75 * 4 / 8)
    assert rule.reward("accepted", None, TEXT) == 0.75  # capped
    assert rule.reward("partial", 2, TEXT) == pytest.approx(0.75 * 2 / 8)
    assert rule.reward("accepted", 3, TEXT) == pytest.approx(0.75 * 3 / 8)  # a count given with 'accepted' wins
    # a short accepted suggestion is worth less than a long one: going silent no longer pays
    assert rule.reward("accepted", None, "ab") < rule.reward("accepted", None, "abcdefgh")


def test_vectorised_matches_scalar_and_rejects_unknown_events():
    rule = RewardRule(accept_scale_by_chars=True)
    events = np.array(["accepted", "rejected", "partial", "none", "accepted"], dtype=object)
    chars, shown = np.array([np.nan, np.nan, 5, np.nan, np.nan]), np.array([10, 10, 10, 10, 0])
    assert rule.rewards(events, chars, shown).tolist() == [
        rule.reward("accepted", None, "x" * 10),
        -0.25,
        rule.reward("partial", 5, "x" * 10),
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="unknown events.*loved"):
        rule.rewards(np.array(["loved"], dtype=object), np.array([np.nan]), np.array([3]))


def test_rule_fields_are_checked_and_identified():
    assert RewardRule(name="tab-chars", version=3).id == "tab-chars@3"
    assert RewardRule().bounds() == (-0.25, 0.75)
    with pytest.raises(ValidationError):
        RewardRule(no_feedback="maybe")
    with pytest.raises(ValidationError):
        RewardRule(acceptd=1.0)  # typo: extra fields are refused
    cfg = CollectSettings(reward_rules={"tab": RewardRule(name="tab-chars", accept_scale_by_chars=True)})
    assert cfg.rule_for("tab").name == "tab-chars" and cfg.rule_for("other").id == "cursor-tab@1"


def _store_with_verdicts(tmp_path):
    store = LocalStore(tmp_path)
    cs = [completion(T0 + i * 1000, text=t) for i, t in enumerate([TEXT, TEXT, TEXT, TEXT, ""])]
    put_logs(store, "completions", cs)
    put_logs(store, "feedback", [feedback(cs[0], "accepted"), feedback(cs[1], "partial", chars=8)])
    return store, cs


@pytest.mark.parametrize("policy", ["drop", "ignored"])
def test_no_feedback_policies_and_the_rule_recorded_with_the_dataset(tmp_path, policy):
    store, cs = _store_with_verdicts(tmp_path)
    rule = RewardRule(name="tab-test", version=7, no_feedback=policy)
    res = collect_once(store, FixedVersions([1], 1), "tab", CollectSettings(reward_rule=rule), T0 + 2 * HOUR)
    got = {r["request_id"]: (r["event"], r["reward"]) for r in res.samples.to_pylist()}
    expected = {
        cs[0]["request_id"]: ("accepted", 0.75),
        cs[1]["request_id"]: ("partial", 0.375),
        cs[4]["request_id"]: ("none", 0.0),
    }  # empty: nothing shown, kept under either policy
    if policy == "ignored":
        expected |= {cs[2]["request_id"]: ("none", 0.0), cs[3]["request_id"]: ("none", 0.0)}
    assert got == expected
    m = res.manifest.stored()
    assert m["reward_rule"]["id"] == "tab-test@7" and RewardRule.model_validate(m["reward_rule"]["rule"]) == rule
    assert set(res.samples["reward_rule"].to_pylist()) == {"tab-test@7"}
    dropped = m["counts"]["completions"]["filtered_by_reason"].get("no_feedback", 0)
    assert dropped == (2 if policy == "drop" else 0)
