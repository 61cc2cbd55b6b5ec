"""A compressed day of traffic (sim/daily_curve.py): the rate's shape and bounds, send times that integrate it, and
simulated users paced by it."""

from __future__ import annotations

import itertools
import time

import pytest

from sim.daily_curve import DailyCurve
from sim.users import SimTraffic, SimUsersConfig


def test_the_rate_peaks_at_the_peak_hour_and_bottoms_out_twelve_hours_later():
    day = DailyCurve(day_s=240.0, peak_rps=8.0, peak_to_trough=4.0, peak_hour=14.0)
    at = {h: day.rate(h * 10.0) for h in range(24)}  # one simulated hour = 10 s
    assert at[14] == pytest.approx(8.0) and at[2] == pytest.approx(2.0) and day.trough_rps == 2.0
    assert max(at, key=at.get) == 14 and min(at, key=at.get) == 2
    assert all(2.0 - 1e-9 <= r <= 8.0 + 1e-9 for r in at.values())
    assert day.hour(240.0 + 35.0) == pytest.approx(3.5)  # the next day
    assert DailyCurve(peak_rps=3.0, peak_to_trough=1.0).rate(123.0) == pytest.approx(3.0)  # a flat day
    late = DailyCurve(day_s=240.0, start_hour=14.0, peak_rps=8.0)
    assert late.rate(0.0) == pytest.approx(8.0)  # a run that starts at the peak


def test_send_times_integrate_the_rate_and_repeat_exactly():
    day = DailyCurve(day_s=240.0, peak_rps=8.0, peak_to_trough=4.0)
    times = list(itertools.takewhile(lambda t: t < 240.0, day.arrivals()))
    assert len(times) == pytest.approx(5.0 * 240.0, abs=2)  # the mean rate, (8 + 2) / 2, over the day
    assert times == sorted(times) and times[:50] == list(itertools.islice(day.arrivals(), 50))
    peak = sum(1 for t in times if 130.0 <= t < 150.0)  # 13:00-15:00
    trough = sum(1 for t in times if 10.0 <= t < 30.0)  # 01:00-03:00
    assert 3.5 < peak / trough < 4.0  # near the 4x of the curve's extremes, averaged over two hours


def test_paced_users_send_at_the_curves_rate_whatever_the_engines_answer():
    curve = DailyCurve(day_s=3600.0, peak_rps=40.0, peak_to_trough=1.0)  # a flat 40 requests/s
    users = SimTraffic(SimUsersConfig(sites=50, concurrency=4, daily=curve), "http://127.0.0.1:9", "k", "tab", 0.2)
    users.start()
    time.sleep(1.0)
    users.stop.set()
    users.join(10)
    assert 30 <= users.sent <= 50  # about 40 in one second, each failing fast against a closed port
    assert users.tally.errors and "completion" in users.tally.errors[0]
