"""bench/tidal.py's figures from what a day recorded: per-minute p99s of the answers, and how long each revocation
took to give serving the replicas it was for."""

from __future__ import annotations

import pytest

from bench.tidal import minute_p99s, restored_s


def test_minute_p99s_cover_whole_minutes_of_the_day_that_answered():
    # minute 0: 99 answers at 100 ms and one at 1 s; minute 1: none; minute 2: ten at 20 ms; 190 s: past the last
    # whole minute of a 200-s day
    at = [0.5 * i for i in range(100)] + [125.0 + i for i in range(10)] + [190.0]
    lat = [100.0] * 99 + [1000.0] + [20.0] * 10 + [9999.0]
    assert minute_p99s(lat, at, 0.0, 200.0) == [pytest.approx(109.0), 20.0]  # numpy's p99 interpolates: 100 + 0.01 x 900


def test_restored_seconds_run_from_each_revocation_to_the_replicas_it_was_for():
    events = [
        {"kind": "grant", "time_ms": 0, "reason": "2 unit(s) free beside serving"},
        {"kind": "revoke", "time_ms": 10_000, "reason": "serving needs tab 2 replica(s) (...); 1 unit(s) left to lend"},
        {"kind": "revoke", "time_ms": 50_000, "reason": "serving needs tab 3 replica(s) (...)"},  # never got there
    ]
    ready = [(5.0, 1), (12.0, 1), (40.5, 2), (60.0, 2)]  # (time s, ready replicas)
    assert restored_s(events, ready) == [pytest.approx(30.5)]
