"""Scores, thumbs and edits through collection over a real local store: one event of each group per completion,
the model's policy enforced by the contract, every refused row quarantined with its reason, the rule's reward from
all of a completion's events, and logs stored before these events existed still collected."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_contracts.collect_settings import CollectSettings
from data_contracts.dataset import read_parquet
from data_contracts.records import FEEDBACK_SCHEMA_V1
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import T0, FixedVersions, completion, feedback, partition_of, put_logs
from tidal.model_settings import FeedbackPolicy
from tidal.store import LocalStore

MIN = 60_000
CHAT = FeedbackPolicy(events=["accepted", "rejected", "partial", "score", "thumbs", "edit"], score_range=(1, 5))
BLEND = CollectSettings(reward_rule={"plugin": "feedback-blend", "no_feedback": "drop"})


def collect(store, cfg=BLEND, policy=CHAT, pii="quarantine"):
    if pii != "quarantine":
        cfg = cfg.model_copy(update={"pii_policy": pii})
    return collect_once(store, FixedVersions([1], 1), "tab", cfg, T0 + 2 * 3_600_000, feedback=policy)


def quarantined_feedback(store, result) -> dict[str, list[str]]:
    """request id#event → its reasons, from the run's quarantine file of feedback rows."""
    key = result.manifest.quarantine["feedback"]
    rows = read_parquet(store, key).to_pylist()
    return {f"{r['request_id']}#{r['event']}": r["reason"].split(",") for r in rows}


def test_a_verdict_a_score_a_thumbs_and_an_edit_on_one_completion_are_one_sample(tmp_path):
    store = LocalStore(tmp_path)
    cs = [completion(T0 + 10 * MIN + i * 1000, i, text="    return a + b") for i in range(4)]
    put_logs(store, "completions", cs)
    put_logs(
        store,
        "feedback",
        [
            feedback(cs[0], "accepted"),
            feedback(cs[0], "score", after_ms=3000, score=5.0),
            feedback(cs[0], "thumbs", after_ms=4000, thumbs="up"),
            feedback(cs[0], "edit", after_ms=5000, edit_text="    return a + b"),
            feedback(cs[1], "score", score=1.0),
            feedback(cs[2], "thumbs", thumbs="down"),
            # cs[3]: no feedback at all → dropped as no_feedback
        ],
    )
    r = collect(store)
    rows = {s["request_id"]: s for s in r.samples.to_pylist()}
    assert set(rows) == {c["request_id"] for c in cs[:3]}
    first = rows[cs[0]["request_id"]]
    assert (first["event"], first["score"], first["thumbs"], first["edit_text"]) == ("accepted", 5.0, "up", "    return a + b")
    assert first["feedback_time_ms"] == cs[0]["time_ms"] + 5000  # the last of its events
    assert first["reward"] == pytest.approx(1.0)  # every signal +1
    assert rows[cs[1]["request_id"]]["reward"] == pytest.approx(-1.0)  # the lowest score
    assert rows[cs[2]["request_id"]]["reward"] == pytest.approx(-1.0)  # thumbs down
    assert rows[cs[1]["request_id"]]["event"] == "none"  # no Tab verdict
    counts = r.manifest.stored()["counts"]
    assert counts["feedback"]["in"] == 6 and counts["feedback"]["kept"] == 6
    assert counts["completions"]["filtered_by_reason"] == {"no_feedback": 1}
    assert r.manifest.reward_rule.plugin == "feedback-blend" and r.manifest.reward_rule.rule["name"] == "feedback-blend"
    assert r.manifest.reward_rule.package  # the distribution that provided the entry point


def test_the_tab_rule_reads_only_tab_verdicts(tmp_path):
    store = LocalStore(tmp_path)
    cs = [completion(T0 + 10 * MIN + i * 1000, i) for i in range(2)]
    put_logs(store, "completions", cs)
    put_logs(
        store,
        "feedback",
        [feedback(cs[0], "rejected"), feedback(cs[0], "thumbs", thumbs="up"), feedback(cs[1], "score", score=4)],
    )
    r = collect(store, cfg=CollectSettings())
    assert r.samples["request_id"].to_pylist() == [cs[0]["request_id"]]  # a score alone is no Tab verdict
    assert r.samples["reward"].to_pylist() == [-0.25] and r.samples["thumbs"].to_pylist() == ["up"]
    assert r.manifest.stored()["counts"]["completions"]["filtered_by_reason"] == {"no_feedback": 1}


def test_the_contract_quarantines_what_the_model_does_not_take_and_conflicting_events(tmp_path):
    store = LocalStore(tmp_path)
    cs = [completion(T0 + 10 * MIN + i * 1000, i) for i in range(6)]
    put_logs(store, "completions", cs)
    put_logs(
        store,
        "feedback",
        [
            feedback(cs[0], "score", score=9.0),  # outside [1, 5]
            feedback(cs[1], "score"),  # no number
            feedback(cs[2], "thumbs", thumbs="up"),
            feedback(cs[2], "thumbs", after_ms=3000, thumbs="down"),  # a second thumbs that disagrees
            feedback(cs[3], "edit"),  # no text
            feedback(cs[4], "accepted"),
            feedback(cs[4], "score", score=3.0),  # a verdict and a score: both kept
            feedback(cs[5], "thumbs", thumbs="up", source="judge"),
        ],
    )
    tab_only = FeedbackPolicy(events=["accepted", "rejected", "partial", "score", "thumbs", "edit"], score_range=(1, 5))
    r = collect(store, policy=tab_only)
    reasons = quarantined_feedback(store, r)
    assert reasons[f"{cs[0]['request_id']}#score"] == ["score_out_of_range"]
    assert reasons[f"{cs[1]['request_id']}#score"] == ["score_without_value"]
    assert reasons[f"{cs[2]['request_id']}#thumbs"] == ["duplicate_request_id"]
    assert reasons[f"{cs[3]['request_id']}#edit"] == ["edit_without_text"]
    key = r.manifest.quarantine["feedback"]
    assert read_parquet(store, key).num_rows == 5  # the two thumbs of cs[2] both
    kept = {s["request_id"]: s for s in r.samples.to_pylist()}
    assert set(kept) == {cs[4]["request_id"], cs[5]["request_id"]}  # the judge's thumbs is feedback too
    assert kept[cs[4]["request_id"]]["score"] == 3.0

    # the same logs for a model that takes Tab's events alone: its scores and thumbs are refused
    store2 = LocalStore(tmp_path / "tab")
    put_logs(store2, "completions", [cs[4]])
    put_logs(store2, "feedback", [feedback(cs[4], "accepted"), feedback(cs[4], "score", score=3.0)])
    r2 = collect(store2, cfg=CollectSettings(), policy=FeedbackPolicy())
    assert quarantined_feedback(store2, r2) == {f"{cs[4]['request_id']}#score": ["event_not_taken"]}
    assert r2.samples.num_rows == 1


@pytest.mark.parametrize("pii", ["quarantine", "scrub"])
def test_an_edit_holding_a_secret_is_quarantined_or_scrubbed_like_a_prompt(tmp_path, pii):
    store = LocalStore(tmp_path)
    c = completion(T0 + 10 * MIN)
    put_logs(store, "completions", [c])
    put_logs(store, "feedback", [feedback(c, "edit", edit_text="    return a + b  # ask bob@example.com")])
    r = collect(store, pii=pii)
    if pii == "quarantine":
        assert quarantined_feedback(store, r) == {f"{c['request_id']}#edit": ["pii:email"]}
        assert r.samples.num_rows == 0
    else:
        assert r.samples["edit_text"].to_pylist() == ["    return a + b  # ask [REDACTED:email]"]
        assert r.manifest.stored()["scrubbed"] == {"email": 1}


def test_feedback_stored_in_the_schema_before_these_events_is_still_collected(tmp_path):
    store = LocalStore(tmp_path)
    c = completion(T0 + 10 * MIN)
    put_logs(store, "completions", [c])
    old = pa.Table.from_pylist([{k: feedback(c, "accepted")[k] for k in FEEDBACK_SCHEMA_V1.names}], schema=FEEDBACK_SCHEMA_V1)
    model, date, hour = partition_of(c["time_ms"])
    local = tmp_path / "old.parquet"
    pq.write_table(old, local)
    store.put_file(local, f"logs/feedback/model={model}/date={date}/hour={hour}/part-old.parquet")
    r = collect(store, cfg=CollectSettings(), policy=FeedbackPolicy())
    assert r.samples["event"].to_pylist() == ["accepted"] and r.manifest.schema_quarantined_files == []
