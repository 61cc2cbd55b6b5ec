"""The deployments each loop mode registers: which schedules and event triggers are active."""

from __future__ import annotations

import pytest

from flows.deployments import deployments
from tidal.settings import load_settings


@pytest.fixture()
def settings_for(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for k in [k for k in __import__("os").environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(k)

    def make(loop: str):
        return load_settings(flywheel={"loop": loop}, models=[{"name": "tab"}, {"name": "chat"}])

    return make


def by_name(settings) -> dict:
    return {d.name: d for d in deployments(settings)}


@pytest.mark.parametrize(
    "loop, collect_on, triggers_on, flywheel_on",
    [("chained", True, True, False), ("flywheel", False, False, True), ("manual", False, False, False)],
)
def test_loop_mode_decides_what_runs_by_itself(settings_for, loop, collect_on, triggers_on, flywheel_on):
    s = settings_for(loop)
    d = by_name(s)
    stages = ("collect", "train", "promote", "flywheel", "rollout")
    assert set(d) == {f"{stage}-{m}" for stage in stages for m in ("tab", "chat")}
    for m in ("tab", "chat"):
        assert [sc.active for sc in d[f"collect-{m}"].schedules] == [collect_on]
        assert [sc.active for sc in d[f"flywheel-{m}"].schedules] == [flywheel_on]
        assert d[f"flywheel-{m}"].schedules[0].schedule.cron == s.flywheel.schedule_cron
        for stage, event, param in (
            ("train", "tidal.dataset.ready", "dataset_id"),
            ("promote", "tidal.candidate.registered", "candidate"),
        ):
            [t] = d[f"{stage}-{m}"].triggers
            assert t.expect == {event} and t.enabled is triggers_on
            assert {k: list(v.root if hasattr(v, "root") else v) for k, v in t.match.items()} == {
                "tidal.model": [m],
                "tidal.driver": ["standalone"],
            }
            assert t.parameters["model"] == m and "event.payload" in t.parameters[param]
            assert not d[f"{stage}-{m}"].schedules
        rollout = d[f"rollout-{m}"]  # started by the registry webhook's receiver only
        assert not rollout.triggers and not rollout.schedules and rollout.concurrency_limit == 1


def test_an_unknown_loop_mode_is_refused(settings_for):
    with pytest.raises(Exception, match="loop"):
        settings_for("sometimes")


def test_a_work_pool_needs_a_fixed_image(settings_for):
    from tidal.section import SettingsError

    for image, why in (
        ("", "needs flywheel.image"),
        ("registry/tidal", "no fixed tag"),
        ("registry/tidal:latest", "no fixed tag"),
    ):
        with pytest.raises((SettingsError, ValueError), match=why):
            load_settings(flywheel={"work_pool": "tidal-kubernetes", "image": image})
    ok = load_settings(flywheel={"work_pool": "tidal-kubernetes", "image": "registry:5000/tidal@sha256:" + "a" * 64})
    assert ok.flywheel.work_pool == "tidal-kubernetes"


def test_work_pool_runs_get_their_stages_service_account(settings_for):
    from flows.deployments import job_variables

    s = load_settings(
        flywheel={"work_pool": "tidal-kubernetes", "image": "registry/tidal:1.2.3", "trainer_service_account": "trainer-sa"}
    )
    assert job_variables(s, "train-tab") == {"service_account_name": "trainer-sa", "automount_service_account_token": True}
    for name in ("collect-tab", "promote-tab", "flywheel-tab"):
        assert job_variables(s, name) == {"service_account_name": "tidal-flows", "automount_service_account_token": False}


def test_a_local_runner_is_refused_when_flows_belong_to_a_pool(settings_for, tmp_path):
    from tidal.platform import Platform
    from tidal.section import SettingsError

    s = load_settings(data_dir=str(tmp_path / "data"), flywheel={"work_pool": "tidal-kubernetes", "image": "r/tidal:1"})
    with pytest.raises(SettingsError, match="register the deployments with `python -m flows.deployments`"):
        Platform(s).up_flows()


def test_a_flow_run_starts_without_the_trainers_libraries():
    # Each flow run imports its flow module in a fresh process (the runner's or a work pool's); the trainer runs in
    # its own process, so torch and transformers (~9 s of a cycle's start on two cores) stay out of the flow's.
    import subprocess
    import sys

    code = (
        "import sys, flows.flywheel, flows.collect, flows.train, flows.promote; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_paused_model_registers_paused_deployments_under_the_names_pause_uses(settings_for):
    from flows.deployments import deployment_names
    from tidal.flywheel_pause import record_pause
    from tidal.store import open_store

    s = settings_for("chained")
    record_pause(open_store(s), "chat", True, "alice", "labels broken")
    d = {f"{dep.flow_name}/{dep.name}": dep for dep in deployments(s)}
    # every flywheel stage is paused; a hand rollout (the registry webhook's) never is, like `tidal rollback`
    assert set(d) == set(deployment_names("tab")) | set(deployment_names("chat")) | {
        "rollout/rollout-tab",
        "rollout/rollout-chat",
    }
    assert {n for n, dep in d.items() if dep.paused} == set(deployment_names("chat"))
