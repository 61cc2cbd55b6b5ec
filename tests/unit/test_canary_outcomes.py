"""Canary outcomes from stored logs, and per-arm counters from the gateway's metrics text."""

from __future__ import annotations

import pytest

from data_contracts.rewards import RewardRule
from release.canary_records import ArmHealth, histories
from release.operations import counters_since, parse_arm_counters
from release.outcomes import LogReader, read_outcomes, request_kind
from tests.unit.test_contracts_data import HOUR, T0, completion, feedback, put_rows
from tidal.store import LocalStore

VERSIONS = {"control": 1, "canary": 3}


@pytest.fixture()
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_resolved_requests_of_the_two_versions_become_outcomes(store) -> None:
    start = T0 + 10_000
    old = completion(T0, 0)  # before the canary started
    acc = completion(start + 1, 1, arm="canary", version=3, text="abcdef")
    part = completion(start + 2, 2, text="abcdef")
    rej = completion(start + 3, 3, arm="canary", version=3)
    empty = completion(start + 4, 4, text="")  # nothing shown: resolved at once
    silent = completion(start + 5, 5)  # no verdict, old enough: 'none'
    pending = completion(start + 60_000, 6)  # no verdict yet, too young: left for a later look
    stale_arm = completion(start + 7, 7, arm="canary", version=2)  # an earlier canary's version
    put_rows(store, "completions", [old, acc, part, rej, empty, silent, pending, stale_arm])
    put_rows(store, "feedback", [feedback(acc), feedback(part, "partial", chars=3), feedback(rej, "rejected")])
    rule = RewardRule()
    logs = LogReader(store, "tab", start)
    got = read_outcomes(logs, VERSIONS, rule, feedback_wait_s=30, now_ms=start + 61_000)
    by_time = {o.time_ms: o for o in got}
    assert sorted(by_time) == [start + t for t in (1, 2, 3, 4, 5)]
    assert by_time[start + 1].arm == "canary" and by_time[start + 1].accepted == 1.0 and by_time[start + 1].accepted_chars == 6
    assert by_time[start + 1].reward == pytest.approx(0.75)
    assert by_time[start + 2].reward == pytest.approx(0.75 * 3 / 6) and by_time[start + 2].accepted_chars == 3
    assert by_time[start + 3].reward == pytest.approx(-0.25) and by_time[start + 3].accepted == 0.0
    assert by_time[start + 4].reward == 0.0 and by_time[start + 5].reward == rule.ignored
    assert all(o.latency_ms == 12.5 for o in got)
    # a later look reads only new objects and sees the verdict that arrived since
    put_rows(store, "feedback", [feedback(silent, "accepted")])
    again = {o.time_ms: o for o in read_outcomes(logs, VERSIONS, rule, feedback_wait_s=30, now_ms=start + 62_000)}
    assert again[start + 5].accepted == 1.0 and len(logs._tables["completions"]) == 1


def test_outcomes_carry_their_kind_user_and_that_users_history(store) -> None:
    """The request kind comes from the prompt (cursor after indentation only: line_start); each user's History is
    built from their control outcomes before the start (`until_ms`), and attached to their outcomes after it."""
    start = T0 + 100_000
    before = [completion(T0 + i, i) for i in (0, 7, 1)]  # users u0, u0, u1: control before the ramp
    after = [
        completion(start + 1, 0, prompt="def f():\n    "),
        completion(start + 2, 1, arm="canary", version=3),
        completion(start + 3, 2),
    ]  # u2 has no history
    put_rows(store, "completions", before + after)
    put_rows(
        store,
        "feedback",
        [feedback(before[0]), feedback(before[1], "rejected"), feedback(before[2]), *(feedback(c) for c in after)],
    )
    rule = RewardRule()
    old = read_outcomes(LogReader(store, "tab", T0), {"control": 1}, rule, 0, start, until_ms=start)
    assert sorted(o.time_ms for o in old) == [T0, T0 + 1, T0 + 7]
    history = histories(old)
    assert history["u0"].n == 2 and history["u0"].accepted == 0.5 and history["u0"].reward == pytest.approx(0.25)
    assert history["u1"].n == 1 and history["u1"].accepted_chars == len("    return a + b")
    got = {o.time_ms: o for o in read_outcomes(LogReader(store, "tab", start), VERSIONS, rule, 0, start + 10_000, history)}
    assert (got[start + 1].kind, got[start + 2].kind, got[start + 3].kind) == ("line_start", "line_start", "line_start")
    assert got[start + 1].history == history["u0"] and got[start + 2].history == history["u1"]
    assert got[start + 3].history is None and got[start + 3].user == "u2"
    assert request_kind("x = foo(") == "mid_line" and request_kind("def f():\n    ") == "line_start"
    assert request_kind("a\nb = ") == "mid_line" and request_kind("") == "line_start"


def test_logs_from_an_hour_before_the_start_are_not_read(store) -> None:
    put_rows(store, "completions", [completion(T0 - 2 * HOUR, 0)])
    assert read_outcomes(LogReader(store, "tab", T0), VERSIONS, RewardRule(), 0, T0 + HOUR) == []


def test_segments_closed_before_the_start_are_not_read(store) -> None:
    start = T0 + 600_000

    def segment(opened_ms: int) -> str:  # the gateway's WAL segment id: creation ms, pid, counter
        return f"{opened_ms:013d}-{4242:07d}-{opened_ms % 1000:06d}"

    # A segment opened 10 minutes before the start (its rows are older in reality: this one's row is planted
    # after the start, so it would count if the object were read), and one opened 3 s before the start.
    old = put_rows(store, "completions", [completion(start + 1, 1)], segment_id=segment(start - 600_000))
    fresh = put_rows(store, "completions", [completion(start + 2, 2)], segment_id=segment(start - 3_000))
    named_otherwise = put_rows(store, "completions", [completion(start + 3, 3)])  # no segment time: always read
    logs = LogReader(store, "tab", start, segment_span_s=65)
    got = read_outcomes(logs, VERSIONS, RewardRule(), feedback_wait_s=0, now_ms=start + 60_000)
    assert sorted(o.time_ms for o in got) == [start + 2, start + 3]
    assert set(logs._tables["completions"]) == {fresh, named_otherwise} and old not in logs._tables["completions"]
    # without a span every object of the hour is read
    everything = read_outcomes(LogReader(store, "tab", start), VERSIONS, RewardRule(), 0, start + 60_000)
    assert sorted(o.time_ms for o in everything) == [start + 1, start + 2, start + 3]


METRICS = """# HELP gateway_completions_total Completions logged
gateway_completions_total{arm="control",model="tab",version="1"} 950.0
gateway_completions_total{arm="canary",model="tab",version="2"} 48.0
gateway_completions_total{arm="control",model="other",version="1"} 7.0
gateway_completion_errors_total{arm="canary",model="tab",version="2"} 2.0
gateway_completions_created{arm="control",model="tab"} 1.7e9
"""


def test_arm_counters_from_prometheus_text() -> None:
    got = parse_arm_counters(METRICS, "tab")
    assert got == {"control": ArmHealth(950, 0), "canary": ArmHealth(50, 2)}


def test_counters_since_the_canary_started_survive_a_gateway_restart() -> None:
    base = {"control": ArmHealth(900, 0), "canary": ArmHealth(40, 1)}
    assert counters_since({"control": ArmHealth(950, 0), "canary": ArmHealth(50, 2)}, base) == {
        "control": ArmHealth(50, 0),
        "canary": ArmHealth(10, 1),
    }
    assert counters_since({"control": ArmHealth(5, 0)}, base) == {"control": ArmHealth(5, 0)}  # counters began again
