"""The capacity scheduler's decisions (capacity/forecast.py, capacity/plan.py, capacity/leases.py): the forecast,
replicas from demand and the latency objective, leases revoked newest first, and two simulated days in which
serving is sized before the peak arrives, training holds the trough, and no minimum is ever breached."""

from __future__ import annotations

import math

import pytest

from capacity.forecast import DemandForecast, Forecast
from capacity.leases import LeaseBook
from capacity.plan import ModelState, Planner
from capacity.settings import CapacitySettings, ForecastSettings
from tidal.model_settings import ServingCapacity


def state(replicas: int, rps: float, p99: float | None = None, **bounds) -> ModelState:
    b = ServingCapacity(**{"min_replicas": 1, "rps_per_replica": 4.0, "headroom": 0.25, **bounds})
    return ModelState("tab", b, b.max_replicas or 4, replicas, Forecast(rps, rps, None), p99)


def test_the_forecast_blends_the_previous_day_and_never_goes_below_the_recent_level():
    f = DemandForecast(ForecastSettings(day_s=1440.0, recent_s=10.0, yesterday_weight=0.5, lookahead_s=60.0))
    for t in range(0, 1440, 5):  # day 1: a peak of 20 req/s between minutes 600 and 700 (1 s = 1 min here)
        f.observe("tab", t, 20.0 if 600 <= t < 700 else 2.0)
    assert f.predict("tab", 1439.0).yesterday == pytest.approx(2.0)  # nothing busy within a lookahead of midnight
    for t in range(1440, 1440 + 560, 5):
        f.observe("tab", t, 2.0)
    ahead = f.predict("tab", 1440 + 560.0)  # 40 s before yesterday's peak, which the 60 s lookahead sees
    assert ahead.yesterday == 20.0 and ahead.rps == pytest.approx(11.0) and ahead.recent == pytest.approx(2.0)
    assert "11.00 req/s forecast (2.00 recently, 20.00 the previous day)" == ahead.explain()
    recent_only = DemandForecast(ForecastSettings(day_s=1440.0, recent_s=10.0, yesterday_weight=0.0))
    recent_only.series = f.series
    assert recent_only.predict("tab", 1440 + 560.0).yesterday is None  # yesterday's peak not looked up
    f.observe("tab", 1440 + 565.0, 30.0)  # a ramp bigger than yesterday's: the latest observation leads
    assert f.predict("tab", 1440 + 565.0).rps == 30.0
    assert DemandForecast(ForecastSettings()).predict("new", 0.0) == Forecast(0.0, 0.0, None)


def test_replicas_follow_demand_headroom_the_latency_objective_and_the_bounds():
    p = Planner(CapacitySettings(total_units=8))
    assert p.needed(state(1, 6.0))[0] == 2  # 6 x 1.25 / 4 = 1.9
    assert p.needed(state(1, 0.0))[0] == 1  # min_replicas
    assert p.needed(state(1, 0.0, min_replicas=0))[0] == 0
    n, why = p.needed(state(2, 1.0, p99=2500.0))  # demand says 1, the objective is broken at 2: 3
    assert n == 3 and "p99 2500 ms over the 2000 ms objective" in why
    n, why = p.needed(state(1, 100.0, max_replicas=3))
    assert n == 3 and "capped at max_replicas 3" in why


def test_leases_are_revoked_newest_first_and_serving_scales_up_only_into_units_given_back():
    cfg = CapacitySettings(total_units=4, scale_down_after_s=0)
    book = LeaseBook(None, grace_s=30, heartbeat_s=5)
    old = book.grant("run-a", 1, 1000, "trough")
    new = book.grant("run-b", 2, 2000, "trough")
    d = Planner(cfg).decide(10.0, [state(1, 9.0)], book.held())  # 9 x 1.25 / 4 -> 3 replicas: 1 unit left to lend
    assert d.needed == {"tab": 3} and d.lendable == 1
    assert [x.id for x, _ in d.revoke] == [new.id] and "serving needs tab 3 replica(s)" in d.revoke[0][1]
    assert d.replicas == {"tab": 1} and d.free_for_leases == 0  # the units are still lent until run-b is back
    book.revoke(new, 3000, d.revoke[0][1])
    book.release(new, 5000)
    d = Planner(cfg).decide(11.0, [state(1, 9.0)], book.held())
    assert d.revoke == [] and d.replicas == {"tab": 3} and book.held() == [old]


def test_a_revoked_lease_not_back_within_the_grace_period_is_reclaimed_and_a_silent_one_too(tmp_path):
    book = LeaseBook(tmp_path / "leases.json", grace_s=30, heartbeat_s=5)
    a, b = book.grant("run-a", 1, 0, "trough"), book.grant("run-b", 1, 0, "trough")
    book.revoke(a, 1_000, "peak")
    book.heartbeat(b, 12_000)
    assert book.overdue(20_000) == []
    assert [(x.id, why) for x, why in book.overdue(31_000)] == [
        (a.id, "not returned within the 30 s grace period after its revocation")
    ]
    assert [x.id for x, _ in book.overdue(51_000)] == [a.id, b.id]  # b silent for 39 s > 4 x 5 s
    # a scheduler restarted at 100 s knows its leases; b's holder could not reach it while it was down, so b's
    # heartbeats count from the restart, while a's deadline (serving's) stays
    again = LeaseBook(tmp_path / "leases.json", grace_s=30, heartbeat_s=5, now_ms=100_000)
    assert [(x.id, x.state) for x in again.held()] == [(a.id, "revoking"), (b.id, "active")]
    assert [e.kind for e in again.events] == ["grant", "grant", "revoke"]
    assert [x.id for x, _ in again.overdue(110_000)] == [a.id]
    assert [x.id for x, _ in again.overdue(121_000)] == [a.id, b.id]


def test_two_simulated_days_size_serving_before_the_peak_and_lend_the_trough():
    """A day of 1,440 s (one per minute): 2 req/s at night, 12 req/s from 10:00 to 16:00, a 20-minute ramp each way.
    Four cores, one per replica; the trainer wants 3 and gives a lease back 20 s after its revocation (grace 60 s).
    Replicas take 30 s to start."""
    day = 1440.0

    def demand(t: float) -> float:
        m = t % day
        up, down = (m - 580) / 20, (980 - m) / 20
        return 2.0 + 10.0 * max(0.0, min(1.0, up, down))

    cfg = CapacitySettings(
        total_units=4,
        scale_down_after_s=60,
        forecast=ForecastSettings(day_s=day, recent_s=30, lookahead_s=120, yesterday_weight=1.0),
    )
    bounds = ServingCapacity(min_replicas=1, max_replicas=4, rps_per_replica=4.0, headroom=0.25)
    forecast, planner, book = DemandForecast(cfg.forecast), Planner(cfg), LeaseBook(None, grace_s=60, heartbeat_s=5)
    replicas, starting, lease, back_at = 1, [], None, None  # starting: when each replica being started is ready
    short, lent_during_trough, revoked_at = [], 0, []
    for t in range(0, int(2 * day), 5):
        ready = [s for s in starting if s <= t]
        replicas, starting = replicas + len(ready), [s for s in starting if s > t]
        forecast.observe("tab", t, demand(t))
        d = planner.decide(
            t, [ModelState("tab", bounds, 4, replicas + len(starting), forecast.predict("tab", t), None)], book.held()
        )
        for x, why in d.revoke:
            book.revoke(x, t * 1000, why)
            back_at, revoked_at = t + 20, [*revoked_at, t]
        if lease is not None and lease.state == "revoking" and t >= back_at:
            book.release(lease, t * 1000)
            lease = None
        want = d.replicas["tab"]
        if want > replicas + len(starting):
            starting += [t + 30] * (want - replicas - len(starting))
        elif want < replicas:
            replicas = want
        if lease is None and d.free_for_leases >= 1:
            lease = book.grant("run", min(3, d.free_for_leases), t * 1000, "trough")
        assert replicas >= 1 and (replicas + len(starting)) * 1 + book.lent_units() <= 4, t  # never over the pool
        if replicas * 4.0 < demand(t):
            short.append(t)
        lent_during_trough += book.lent_units() if (t % day) < 500 else 0
    assert short and max(short) < day  # day 1, without history, lags the ramp (the recent average and the start)
    assert [t for t in short if t >= day] == []  # day 2: a day of history, serving is up before the ramp
    assert any(day + 400 < t < day + 580 for t in revoked_at)  # revoked ahead of the 09:40 ramp, from yesterday's curve
    assert lent_during_trough >= 3 * 2 * (500 // 5) * 0.9  # the trainer held 3 cores through both nights
    assert math.isclose(demand(day + 700), 12.0)


def test_tidal_settings_are_checked_at_start_up_and_size_the_trainers_lease():
    from tasks.train import lease_terms, trainer_threads
    from tests.unit.trainer_fixtures import spec
    from tidal.section import SettingsError
    from tidal.settings import load_settings

    def tidal(total: int, models: list[dict], **cap):
        return load_settings(capacity={"mode": "tidal", "total_units": total, **cap}, models=models)

    with pytest.raises(
        SettingsError, match=r"model tab: replicas=4 is outside models\[\].capacity \[min_replicas=1, max_replicas=3\]"
    ):
        tidal(8, [{"name": "tab", "replicas": 4, "capacity": {"max_replicas": 3}}])
    with pytest.raises(SettingsError, match=r"min_replicas need 3 unit\(s\) but capacity has 2 usable"):
        tidal(3, [{"name": "tab", "replicas": 3, "capacity": {"min_replicas": 3}}], reserved_units=1)
    with pytest.raises(SettingsError, match=r"lease.min_units=2 never fits beside the models' min_replicas \(1 unit"):
        tidal(2, [{"name": "tab", "replicas": 1}], lease={"min_units": 2})
    with pytest.raises(SettingsError, match=r"grace_s=10 is not above capacity.lease.heartbeat_s=15"):
        tidal(2, [{"name": "tab", "replicas": 1}], lease={"grace_s": 10})
    assert load_settings(models=[{"name": "tab", "replicas": 4, "capacity": {"max_replicas": 3}}])  # static: not checked

    s = tidal(4, [{"name": "tab", "replicas": 2, "capacity": {"max_replicas": 3}}])
    terms = lease_terms(s, spec().model_copy(update={"torch_threads": trainer_threads(s)}))
    assert trainer_threads(s) == 3 and terms is not None and terms.units == 3  # the cores beside serving's minimum
    assert terms.url == "http://127.0.0.1:8095" and terms.token not in repr(terms)
    assert lease_terms(load_settings(), spec()) is None  # static: the trainer runs when the flow starts it


def test_demand_is_the_rate_over_the_window_and_the_p99_over_the_minute():
    from capacity.observe import Observer, Scrape

    obs = Observer("http://gateway", "http://fleet", "token", window_s=60.0, rate_window_s=15.0)
    counts = [0, 10, 12, 30, 31, 33]  # requests so far at t = 0, 5, ..., 25 s: a burst of 18 in one tick
    for i, n in enumerate(counts):
        obs.scrapes.append(Scrape(5.0 * i, {"tab": float(n)}, {"tab": {1000.0: n * 0.995, float("inf"): float(n)}}))
    rps, p99 = obs.demand("tab")
    assert rps == pytest.approx((33 - 12) / 15)  # since the newest scrape 15 s old, not the latest tick's 0.4 req/s
    assert p99 == 1000.0  # 99.5% of the minute's 33 requests within 1 s
    assert Observer("g", "f", "t", rate_window_s=100.0).demand("tab") == (None, None)  # fewer than two scrapes
    young = Observer("g", "f", "t", rate_window_s=100.0)
    young.scrapes.extend(obs.scrapes)
    assert young.demand("tab")[0] == pytest.approx(33 / 25)  # no scrape that old yet: since the oldest kept
