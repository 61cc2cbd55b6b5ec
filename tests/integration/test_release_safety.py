"""Release safety on the real platform: a release that dies or fails mid-ramp leaves no canary behind (the
gateway's release watchdog; the flow's own rollback), and a release after a crash between the route and alias
writes finds the routes authoritative (release/live_state.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.integration.release_helpers import Promote, start_at_first_step, tab_arms, tags
from tidal.registry import publish

pytestmark = pytest.mark.slow


def test_a_promote_run_killed_mid_ramp_leaves_no_canary_behind(
    settings, registry, checkpoints, neutral_adapter, users, tmp_path, platform, chaos_report
):
    """kill -9 of the process running a release (the CLI here; a runner or a worker pod likewise) left its canary
    routed at its weight with nothing watching it, for good. The gateway's watchdog now takes it off."""
    info = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, {"tidal.origin": "test: killed release"})
    watchdog_s = 8.0  # ≥ 3 × the session's 2 s looks
    env = {**os.environ, "TIDAL_CANARY__WATCHDOG_S": str(watchdog_s), "TIDAL_CANARY__MIN_SAMPLES": "1000000"}
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    start_at_first_step(users, registry, promote, info.version)
    time.sleep(5)  # the ramp runs, checking in at every look
    assert tab_arms(platform)[1][:2] == ("canary", info.version)
    promote.proc.kill()
    killed = time.monotonic()
    promote.proc.wait(timeout=30)
    while len(tab_arms(platform)) == 2:
        assert time.monotonic() - killed < watchdog_s + 10, "the canary outlived its release"
        time.sleep(0.2)
    back_s = time.monotonic() - killed
    last = platform.routes_client().show().routes["tab"]
    assert tab_arms(platform) == [("control", 1, 1.0)] and last.updated_by == "watchdog", last
    time.sleep(3)  # users keep being served by the control arm
    users.stop.set()
    users.join(timeout=120)
    chaos_report.record(
        "11. promote run killed mid-ramp (kill -9)",
        watchdog_s=watchdog_s,
        traffic_back_on_control_s=round(back_s, 1),
        client_errors=len(users.errors),
    )
    # The check-in deadline was at most watchdog_s after the kill, then one 1 s watchdog period and this loop's
    # polls of a busy gateway: a few seconds' slack (10.5 s once on a loaded 2-core runner), far from 'never'.
    assert back_s <= watchdog_s + 5.0, back_s
    assert users.errors == []
    platform.fleet_client().undeploy("tab", info.version)


def test_a_release_that_fails_mid_ramp_takes_its_canary_off_at_once(
    settings, registry, checkpoints, neutral_adapter, tmp_path, platform, s3_endpoint
):
    """An error raised out of the flow mid-ramp (here the object store holding the logs cannot be reached) left the
    canary at its weight. The flow now rolls it back before it fails, and says why on the version."""
    info = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, {"tidal.origin": "test: failing release"})
    # This process only: its log reads go to a bucket that does not exist; the fleet and gateway are untouched. No
    # users' history is read before the ramp (that read would fail before any canary is routed): the first look fails.
    env = {
        **os.environ,
        "TIDAL_STORE__ROUTES": json.dumps({"logs": "s3://no-such-bucket-tidal"}),
        "TIDAL_STORE__S3_ENDPOINT_URL": s3_endpoint,
        "TIDAL_CANARY__HISTORY_S": "0",
    }
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    rc, out = promote.finish(timeout=600)
    assert rc != 0 and "NoSuchBucket" in out, out[-3000:]
    t = tags(registry, info.version)
    assert "tidal.release.step_1" in t, out[-3000:]  # it failed mid-ramp, not before
    ended = json.loads(t["tidal.release.rolled_back"])
    assert ended["by"] == "promote" and ended["reason"].startswith("the release failed:"), ended
    assert tab_arms(platform) == [("control", 1, 1.0)]
    assert all(f"tab@v{info.version}" not in r.served for r in platform.fleet_client().replicas("tab"))


def test_a_release_after_a_crash_between_the_route_and_alias_writes_finds_the_routes_authoritative(
    settings, registry, checkpoints, neutral_adapter, tmp_path, platform
):
    """A promotion that died after its route change but before the aliases left routes on vN, the champion alias
    on v1 and the fleet on v1; releasing vN again then built a canary whose two arms were both vN."""
    info = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, {"tidal.origin": "test: half promoted"})
    fleet, routes = platform.fleet_client(), platform.routes_client()
    fleet.deploy("tab", info.version)
    deadline = time.monotonic() + 60
    while True:  # the gateway learns of the new adapter at its next fleet poll
        try:
            routes.set(
                "tab", [{"name": "control", "version": info.version, "weight": 1.0}], by="promote", reason="crashed after this"
            )
            break
        except Exception:  # noqa: BLE001  409 until the gateway has polled the fleet
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert registry.aliases("tab")["champion"] == 1  # the crash: no alias written
    rc, out = Promote(info.version, tmp_path / "promote.log").finish(timeout=300)
    assert rc != 0 and f"v{info.version} is already the champion" in out, out[-3000:]
    assert "reconciled champion alias: v1 → v" in out, out[-3000:]
    aliases = registry.aliases("tab")
    assert (aliases["champion"], aliases["previous"]) == (info.version, 1)
    assert fleet.status().models["tab"].serving_version == info.version
    assert tab_arms(platform) == [("control", info.version, 1.0)]  # no canary of vN against vN
    rb = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "rollback", "tab", "--to", "1", "--reason", "test cleanup"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    assert rb.returncode == 0 and registry.aliases("tab")["champion"] == 1, rb.stdout + rb.stderr
    fleet.undeploy("tab", info.version)
