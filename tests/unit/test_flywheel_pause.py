"""Pausing a model's flywheel: the stored records, the one in force, the refusal every stage raises, and the
canary settings that make a step wait for a human."""

from __future__ import annotations

import pytest

from release.canary_config import CanaryConfig
from release.policy import Ramp
from tidal.flywheel_pause import FlywheelPaused, ensure_running, latest_pause, pause_prefix, paused, record_pause
from tidal.store import LocalStore


def test_the_latest_record_is_in_force_and_every_record_is_kept(tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    assert latest_pause(store, "tab") is None and paused(store, "tab") is None
    ensure_running(store, "tab", "collect")  # never paused: runs

    first = record_pause(store, "tab", True, "alice", "bad labels upstream")
    assert paused(store, "tab") == first
    assert paused(store, "chat") is None  # per model
    with pytest.raises(FlywheelPaused) as e:
        ensure_running(store, "tab", "collect")
    message = str(e.value)
    assert "collect refused" in message and "alice" in message and "bad labels upstream" in message
    assert "`tidal resume tab`" in message

    record_pause(store, "tab", False, "bob", "fixed")
    assert paused(store, "tab") is None and latest_pause(store, "tab").by == "bob"
    ensure_running(store, "tab", "train")
    again = record_pause(store, "tab", True, "carol")
    assert paused(store, "tab") == again
    assert len(store.list(pause_prefix("tab"))) == 3  # the audit: who paused and resumed, when and why


def test_approve_before_names_steps_or_the_promotion() -> None:
    assert CanaryConfig(approve_before=[1.0]).approve_before == [1.0]
    assert CanaryConfig(steps=[0.05, 0.25, 0.5], approve_before=[0.5, 1.0]).approve_before == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"approve_before.*\[0\.3\] is not a step.*canary.steps"):
        CanaryConfig(steps=[0.05, 0.25, 0.5], approve_before=[0.3])


def test_a_step_restarts_when_its_traffic_moves_after_an_approval() -> None:
    from release.canary_records import ArmHealth, Outcome

    cfg = CanaryConfig(steps=[0.1, 0.5], min_samples=10, min_test_samples=5)
    ramp = Ramp(cfg, now_s=0.0)
    ramp.step, ramp.step_started_s, ramp.step_starts_ms = 1, 100.0, [1_000]  # what an advancing look leaves
    ramp.restart_step(now_s=4_000.0, clock_ms=3_901_000)  # an hour later a human approved
    assert (ramp.step, ramp.step_started_s, ramp.step_starts_ms) == (1, 4_000.0, [3_901_000])
    # 12 canary outcomes served while the human decided, 3 after: the step has 3 of its 10, not 15
    waited = [Outcome("canary", 0.5, 1.0, 10.0, 20.0, time_ms=2_000_000 + i) for i in range(12)]
    after = [Outcome("canary", 0.5, 1.0, 10.0, 20.0, time_ms=3_902_000 + i) for i in range(3)]
    control = [Outcome("control", 0.5, 1.0, 10.0, 20.0, time_ms=2_000_000 + i) for i in range(20)]
    result = ramp.observe(waited + after + control, {"canary": ArmHealth(15, 0), "control": ArmHealth(20, 0)}, 4_010.0)
    assert result.action == "wait" and "3/10 canary outcomes" in result.reason, result.reason
