"""Flywheel reporting: per-version figures from a dataset's rows, the cycle table, the demo's settings profile
and stop signals."""

from __future__ import annotations

import os
import time

import pytest

from data_contracts.samples import RewardSample
from tasks.cycle_report import CycleReport, cycle_table
from tasks.flywheel import served_metrics
from tidal.demo import demo_profile, requests_before, wait_for_traffic
from tidal.settings import load_settings


def sample(version: int, text: str, event: str, reward: float, chars: int | None = None) -> RewardSample:
    return RewardSample(
        request_id=f"r{version}{text}{event}",
        model="tab",
        version=version,
        arm="control",
        user_hash="u",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        behaviour_logprobs=[-0.1],
        completion_text=text,
        event=event,
        accepted_chars=chars,
        reward=reward,
        reward_rule="cursor-tab@1",
        completion_time_ms=0,
    )


def test_served_metrics_per_version():
    rows = [
        sample(1, "abc", "accepted", 0.75),
        sample(1, "abcdef", "partial", 0.4, 4),
        sample(1, "", "none", 0.0),
        sample(1, "zz", "rejected", -0.25),
        sample(2, "x", "rejected", -0.25),
    ]
    m = served_metrics(rows)
    assert m[1] == pytest.approx(
        {
            "requests": 4,
            "suggestion_rate": 0.75,
            "accept_rate": 1 / 3,
            "reward_per_request": 0.9 / 4,
            "accepted_chars_per_request": 7 / 4,
        }
    )
    assert m[2]["accept_rate"] == 0 and m[2]["suggestion_rate"] == 1


def test_cycle_table_says_what_was_decided_and_why():
    r = CycleReport(
        model="tab",
        cycle=2,
        champion_before=3,
        dataset_id="ds-1",
        rows=800,
        candidate=4,
        decision="rolled_back",
        reason="reward fell",
        champion_after=3,
        served={
            3: {
                "requests": 800,
                "suggestion_rate": 0.9,
                "accept_rate": 0.1,
                "reward_per_request": -0.1,
                "accepted_chars_per_request": 0.5,
            }
        },
    )
    table = cycle_table([r])
    assert "rolled_back v4 → champion v3" in table and "why: reward fell" in table and "0.900" in table
    assert r.row()["decision"] == "rolled_back" and r.row()["suggestion_rate"] == 0.9


class Users:
    """The two things the demo reads of its running SimTraffic: requests sent, and whether it still runs."""

    def __init__(self, sent: int, per_poll: int = 0) -> None:
        self._sent, self.per_poll, self.tally = sent, per_poll, type("Tally", (), {"errors": []})()

    @property
    def sent(self) -> int:
        self._sent += self.per_poll  # the users keep sending while the demo waits
        return self._sent

    def is_alive(self) -> bool:
        return True


def test_a_cycle_waits_only_for_requests_not_yet_collected(monkeypatch):
    monkeypatch.setattr("tidal.demo.time.sleep", lambda s: None)
    busy = Users(sent=5000)  # the users sent 4000 requests while the last cycle (collected at 1000) ran
    wait_for_traffic(busy, since=1000, n=1200, desc="t")
    assert busy._sent == 5000  # no wait: enough arrived during the cycle
    fresh = Users(sent=1000, per_poll=100)  # right after a collect at 1000
    wait_for_traffic(fresh, since=1000, n=1200, desc="t")
    assert 2200 <= fresh._sent <= 2400  # waited for 1200 more, not a request longer than a poll


def test_the_first_cycle_waits_for_more_traffic_than_later_ones(monkeypatch, tmp_path):
    # The first candidate learns from version 1's logs alone; later ones also from the traffic of the cycle before.
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    demo = load_settings().demo
    assert requests_before(demo, 1) == demo.first_cycle_requests > demo.requests_per_cycle
    assert requests_before(demo, 2) == requests_before(demo, 7) == demo.requests_per_cycle
    monkeypatch.setenv("TIDAL_DEMO__FIRST_CYCLE_REQUESTS", "60")
    assert requests_before(load_settings().demo, 1) == 60


def test_demo_profile_replaces_canary_and_training_and_stops_schedules(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for k in [k for k in __import__("os").environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    s = demo_profile(load_settings(), "tab")
    assert s.canary == s.demo.canary and s.flywheel.loop == "manual"
    assert s.canary.steps == [0.25, 0.5]
    # Static: the users are quiet while a cycle trains, so the trainer gets every core; otherwise the fleet's leftovers.
    # (Under the tide the trainer's threads are its lease's: test_demo_tide.py.)
    assert s.train == s.demo.train.model_copy(update={"torch_threads": os.cpu_count()}) and s.demo.quiet_while_training
    assert s.capacity.mode == "static" and s.demo.users.daily is None  # closed-loop users, as before the tide
    monkeypatch.setenv("TIDAL_DEMO__QUIET_WHILE_TRAINING", "false")
    assert demo_profile(load_settings(), "tab").train.torch_threads is None


def test_the_demo_serves_its_full_weight_candidates_with_a_full_checkpoint_strategy(monkeypatch, tmp_path):
    from tidal.section import SettingsError

    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    plain = load_settings()
    assert plain.models[0].update_strategy == "lora" and not plain.demo.train.ppo.lora
    assert [m.update_strategy for m in demo_profile(plain, "tab").models] == ["restart"]  # the demo's, for its run only
    (tmp_path / "tidal.yaml").write_text("demo:\n  update_strategy: null\n")  # each model's own: lora, which
    with pytest.raises(SettingsError, match="model 'tab' \\(update_strategy 'lora'\\) with demo.train.ppo.lora=false.*'restart'"):
        demo_profile(load_settings(), "tab")  # cannot load full-weight candidates
    (tmp_path / "tidal.yaml").write_text(
        "demo:\n  update_strategy: null\n  train:\n    ppo:\n      lora: true\n"
        "      final_norm_learning_rate: null\n      sharpen_temperature: null\n"
    )
    assert [m.update_strategy for m in demo_profile(load_settings(), "tab").models] == ["lora"]


def test_the_demo_replaces_the_strategy_of_the_model_it_cycles_alone(monkeypatch, tmp_path):
    """The other models keep their strategies (the fleet serving them need not restart), and their strategy is no
    reason to refuse the demo's training settings, which never train them."""
    from tidal.section import SettingsError

    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)
    (tmp_path / "tidal.yaml").write_text(
        "models:\n- {name: tab, update_strategy: lora}\n- {name: tabfull, update_strategy: restart}\n"
        "demo:\n  update_strategy: lora\n  train:\n    ppo:\n      lora: true\n"
        "      final_norm_learning_rate: null\n      sharpen_temperature: null\n"
    )
    settings = load_settings()
    assert [m.update_strategy for m in demo_profile(settings, "tab").models] == ["lora", "restart"]
    assert [m.update_strategy for m in demo_profile(settings, "tabfull").models] == ["lora", "lora"]
    own = settings.model_copy(update={"demo": settings.demo.model_copy(update={"update_strategy": None})})
    assert [m.update_strategy for m in demo_profile(own, "tab").models] == ["lora", "restart"]  # tabfull's is no matter
    with pytest.raises(SettingsError, match="model 'tabfull' \\(update_strategy 'restart'\\) with demo.train.ppo.lora=true"):
        demo_profile(own, "tabfull")


def test_quiet_users_send_nothing_until_the_trough_ends():
    from sim.users import SimTraffic, SimUsersConfig

    # Nothing listens on port 9: every request the users send fails at once and is counted as an error.
    traffic = SimTraffic(SimUsersConfig(sites=50, concurrency=2, think_s=(0.0, 0.0)), "http://127.0.0.1:9", "k", "tab", 0.2)
    traffic.quiet.set()
    traffic.start()
    try:
        time.sleep(1.0)
        assert traffic.sent == 0 and traffic.tally.errors == []
        traffic.quiet.clear()
        deadline = time.monotonic() + 30
        while traffic.sent == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert traffic.sent > 0 and "completion" in traffic.tally.errors[0]
    finally:
        traffic.stop.set()
        traffic.join(timeout=30)
    assert not traffic.is_alive()


def test_plot_has_a_panel_per_metric(tmp_path):
    from sim.evaluate import Estimate
    from tidal.demo import plot_versions
    from tidal.heldout_eval import METRIC_NAMES

    rows = [
        {"label": label, "kind": kind, **{m: Estimate(x, x - 0.01, x + 0.01) for m in METRIC_NAMES}}
        for label, kind, x in (("v1", "version", 0.1), ("v4", "version", 0.2), ("v1 cut@3", "baseline", 0.15))
    ]
    png = plot_versions(rows, tmp_path / "out" / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_demo_stops_on_sigterm_and_an_inherited_ignored_sigint_as_on_ctrl_c():
    import os
    import signal

    from tidal.demo import stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a non-interactive shell starts
        stop_on_signals()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), sig)
                signal.sigtimedwait([], 0.5)  # let the handler run (it runs between bytecodes of this thread)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_cycle_report_is_read_back_as_itself_and_refuses_an_unknown_decision():
    from pydantic import ValidationError

    r = CycleReport(model="tab", cycle=1, champion_before=1, dataset_id="ds-1", rows=10, served={1: {"requests": 10.0}})
    stored = r.model_dump(mode="json")
    assert list(stored["served"]) == ["1"] and CycleReport.model_validate(stored) == r  # version keys back to ints
    with pytest.raises(ValidationError, match="decision"):
        r.decision = "promotd"


def test_a_cycle_before_any_dataset_waits_for_logs_instead_of_failing(tmp_path) -> None:
    """A first cycle whose collection found nothing old enough (all records younger than upload_grace_s) used to fail
    in train with 'dataset  of tab not found'; it is a no_new_data cycle that says why."""
    from tasks.flywheel import open_cycle
    from tidal.registry import VersionInfo
    from tidal.store import LocalStore

    class Champion:
        def by_alias(self, model, alias):
            return VersionInfo(model, 1, "full", 1, "file:///ckpt")

    report = open_cycle.fn(Champion(), LocalStore(tmp_path), "tab", 1, "")
    assert report.decision == "no_new_data" and report.rows == 0 and report.champion_after == 1
    assert "collect.upload_grace_s" in report.reason
