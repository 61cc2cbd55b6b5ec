"""The demo on the tide (tidal/demo_tide.py): the profile that puts its cycles on the capacity scheduler, and the
figures and plot of the timeline it samples. The demo on the real platform is tests/integration/test_rl_flywheel.py's."""

from __future__ import annotations

import os

import pytest

from capacity.leases import LeaseEvent
from tasks.train import trainer_threads
from tidal.demo import demo_profile
from tidal.demo_tide import TideSample, plot_tide, summarize_tide
from tidal.section import SettingsError
from tidal.settings import load_settings


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No TIDAL_ settings but the tide's."""
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TIDAL_DEMO__CAPACITY__MODE", "tidal")
    return tmp_path


def test_the_demo_is_static_unless_asked_for_the_tide(monkeypatch, clean):
    monkeypatch.delenv("TIDAL_DEMO__CAPACITY__MODE")
    s = demo_profile(load_settings(), "tab")
    assert (
        s.capacity.mode == "static" and s.demo.users.daily is None and s.models[0].capacity == load_settings().models[0].capacity
    )


def test_the_demo_on_the_tide(clean):
    plain = load_settings()
    s = demo_profile(plain, "tab")
    cap, [tab] = s.capacity, s.models
    assert cap.mode == "tidal" and (cap.host, cap.port) == (plain.capacity.host, plain.capacity.port)
    # The users follow the demo's day, and the scheduler forecasts on the same day.
    assert s.demo.users.daily == s.demo.day and cap.forecast.day_s == s.demo.day.day_s == 900
    assert s.demo.day.trough_rps == 2.0 and s.demo.day.peak_rps == 8.0
    # The cycled model between the demo's bounds; the trainer's threads are what a lease beside its minimum holds.
    assert tab.capacity == s.demo.serving and (tab.capacity.min_replicas, tab.capacity.max_replicas) == (1, 2)
    assert tab.replicas == 1 and trainer_threads(s) == max(1, cap.usable_units - 1)
    assert s.train.torch_threads is None  # not every core: that is the static demo's quiet trough


def test_the_other_models_keep_their_replicas_and_the_cycled_one_moves_into_its_bounds(clean):
    (clean / "tidal.yaml").write_text(
        "models:\n- {name: tab, replicas: 3}\n- {name: tabfull, replicas: 1, update_strategy: restart}\n"
        "- {name: byo, replicas: 0}\ncapacity:\n  total_units: 6\n"
        "demo:\n  capacity:\n    total_units: 6\n  serving:\n    min_replicas: 1\n    max_replicas: 2\n"
    )
    s = demo_profile(load_settings(), "tab")
    bounds = {m.name: (m.replicas, m.capacity.min_replicas, m.capacity.max_replicas) for m in s.models}
    assert bounds == {"tab": (2, 1, 2), "tabfull": (1, 1, 1), "byo": (0, 0, 1)}
    assert s.capacity.total_units == 6 and s.capacity.tick_s == 2.0  # settings given, the demo's others kept


def test_a_tide_that_does_not_fit_names_the_demo_settings_to_change(clean):
    (clean / "tidal.yaml").write_text("demo:\n  capacity:\n    total_units: 1\n")
    with pytest.raises(
        SettingsError, match="(?s)the demo's tide.*lease.min_units=1 never fits.*in 1 usable.*demo.serving and demo.capacity"
    ):
        demo_profile(load_settings(), "tab")
    (clean / "tidal.yaml").write_text("demo:\n  serving:\n    min_replicas: 3\n    max_replicas: 2\n")
    with pytest.raises(SettingsError, match="demo.serving.max_replicas=2 is below demo.serving.min_replicas=3"):
        load_settings()


def test_users_with_a_day_of_their_own_set_the_forecast_day(clean):
    (clean / "tidal.yaml").write_text("demo:\n  users:\n    daily: {day_s: 120, peak_rps: 3}\n")
    s = demo_profile(load_settings(), "tab")
    assert s.demo.users.daily.day_s == 120 and s.capacity.forecast.day_s == 120


def samples() -> list[TideSample]:
    def look(t, replicas, lent, events=(), p99=500.0):
        return TideSample(
            t_s=t, hour=t / 25, scheduled_rps=1 + t / 100, observed_rps=1.0, forecast_rps=1.2, replicas=replicas,
            lent_units=lent, p99_ms=p99,
            events=[LeaseEvent(time_ms=int(t * 1000), kind=k, holder="run", units=1, reason=k) for k in events],
        )  # fmt: skip

    return [
        look(0, 1, 0),
        look(2, 1, 1, ["grant"]),
        look(4, 1, 1),
        look(6, 2, 0, ["revoke", "release"], p99=2500.0),
        TideSample(t_s=8, hour=0.3, scheduled_rps=3, observed_rps=None, forecast_rps=None, replicas=None, lent_units=None),
        look(10, 2, 1, ["grant"]),
    ]


def test_the_tide_in_figures():
    summary = summarize_tide(samples(), objective_ms=2000.0)
    # Five looks answered (one missed: the scheduler was down), three of them with units lent.
    assert summary.lent_share == 0.6 and (summary.grants, summary.revocations) == (2, 1)
    assert (summary.replicas_min, summary.replicas_max) == (1, 2) and summary.minutes == round(10 / 60, 2)
    assert summary.p99_over_objective_share == 0.2  # one of the five looks with a p99 was over 2 s
    assert "2 lease(s) granted, 1 revoked" in summary.describe() and "60%" in summary.describe()
    assert "over its objective in 20% of the looks" in summary.describe()


def test_the_tide_plot_is_written(tmp_path):
    png = plot_tide(samples(), "tab", 2000.0, tmp_path / "demo" / "tab-tide.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
