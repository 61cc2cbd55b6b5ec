"""Tidal scheduling on the real platform: the capacity scheduler process (capacity/scheduler.py) lends the trough to
a real training run, takes its lease back at a traffic ramp through the gateway (the trainer checkpoints the
iteration in progress and stops), scales the model into the unit given back, and hands a lease back once the ramp
is over, on which the run resumes from that checkpoint and registers one candidate. Serving answers every request,
no model ever drops below its minimum, and killing the scheduler leaves serving as it was.

That a run resumed from a preemption checkpoint ends with the weights of an uninterrupted one, bit for bit, is
tests/unit/test_preemption.py's (the same load-and-continue the trainer runs here). A shorter test in the suite:
a lease granted in the trough, the scheduler killed under it (serving unchanged, the holder keeps its lease) and
restarted (it reads its book back)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from capacity.api import LeaseRequest
from capacity.client import LeaseClient, LeaseWatch
from tests.integration.train_helpers import complete, pushed_training
from tidal.tokens import admin_token

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ramp(threading.Thread):
    """A traffic ramp on tab: four users, each a request every 0.5 s, until stopped; answers and errors counted."""

    def __init__(self, gateway: str, key: str):
        super().__init__(daemon=True)
        self.gateway, self.key, self.ok, self.errors, self.stop = gateway, key, 0, [], threading.Event()

    def run(self) -> None:
        def user(i: int) -> None:
            while not self.stop.is_set():
                try:
                    complete(self.gateway, self.key, f"def ramp_{i}(x):\n    ", f"ramp-{i}")
                    self.ok += 1
                except Exception as e:  # noqa: BLE001  counted, asserted on below
                    self.errors.append(repr(e))
                time.sleep(0.5)

        users = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(4)]
        for u in users:
            u.start()
        for u in users:
            u.join()


class FleetWatch(threading.Thread):
    """The fewest ready replicas each model had, read from the supervisor every half second until stopped."""

    def __init__(self, fleet):
        super().__init__(daemon=True)
        self.fleet, self.fewest, self.most, self.stop = fleet, {}, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for name, m in self.fleet.status().models.items():
                ready = sum(r.state == "ready" for r in m.replicas)
                self.fewest[name] = min(self.fewest.get(name, ready), ready)
                self.most[name] = max(self.most.get(name, ready), ready)


def wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:  # a process still starting
            value = None
        if value is not None and value is not False:
            return value
        assert proc is None or proc.poll() is None, f"the train command ended while waiting for {what}"
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s:g} s")


def start_scheduler(settings, env: dict[str, str]) -> subprocess.Popen:
    with open(settings.log_dir / "capacity-test.log", "ab") as log:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "capacity.scheduler"], env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.timeout(300)
def test_a_lease_granted_in_the_trough_outlives_a_scheduler_crash_that_serving_never_notices(
    settings, gateway, keys, platform, tmp_path
):
    # Every model held at the replicas it runs now (nothing to scale: no engine starts), one unit beside them to lend.
    fleet = platform.fleet_client()
    running = {name: m.desired_replicas for name, m in fleet.status().models.items()}
    models = [m.model_dump(mode="json") for m in settings.models]
    for m in models:
        n = running[m["name"]]
        m["replicas"], m["capacity"] = n, {"min_replicas": n, "max_replicas": max(n, 1)}
    port, token = free_port(), admin_token(settings)
    env = {
        **os.environ,
        "TIDAL_MODELS": json.dumps(models),
        "TIDAL_DATA_DIR": str(tmp_path / "data"),  # the scheduler's lease book only: its own, not the session's
        "TIDAL_CAPACITY__MODE": "tidal",
        "TIDAL_CAPACITY__TOTAL_UNITS": str(sum(running.values()) + 1),
        "TIDAL_CAPACITY__PORT": str(port),
        "TIDAL_CAPACITY__TICK_S": "1",
        "TIDAL_CAPACITY__LEASE__HEARTBEAT_S": "0.5",
        "TIDAL_CAPACITY__LEASE__GRACE_S": "30",
    }
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
    scheduler = start_scheduler(settings, env)
    try:
        wait_for("decision", lambda: httpx.get(f"{url}/capacity", headers=auth).json()["decided_at_ms"], 60, scheduler)
        client, revoked = LeaseClient(url, token), threading.Event()
        lease = client.acquire(LeaseRequest(holder="run-trough", min_units=1, max_units=1), sleep=lambda s: time.sleep(0.3))
        assert lease.units == 1 and lease.state == "active"
        with LeaseWatch(client, lease, revoked, 0.5) as watch:
            scheduler.send_signal(signal.SIGKILL)  # a crash
            scheduler.wait(10)
            for i in range(4):  # serving answers as before, through heartbeats that now fail
                complete(gateway, keys["alice"], f"def crashed_{i}(x):\n    ", f"crash-{i}")
                time.sleep(0.5)
            assert not revoked.is_set() and watch.revoked is None  # the holder keeps its lease: its trainer runs on
            assert {name: m.desired_replicas for name, m in fleet.status().models.items()} == running
            scheduler = start_scheduler(settings, env)  # back: it reads its book, and the lease is still the holder's
            status = wait_for("restart", lambda: httpx.get(f"{url}/capacity", headers=auth).json(), 60, scheduler)
            assert [(x["id"], x["state"]) for x in status["leases"]] == [(lease.id, "active")]
            time.sleep(1.5)  # heartbeats reach it again
            assert not revoked.is_set()
        client.release(lease.id)
        status = httpx.get(f"{url}/capacity", headers=auth).json()
        assert status["leases"] == [] and [e["kind"] for e in status["events"] if e["kind"] != "scale"] == ["grant", "release"]
        assert all(e["kind"] != "scale" for e in status["events"])  # nothing was scaled
    finally:
        scheduler.kill()
        scheduler.wait(10)
    assert {name: m.desired_replicas for name, m in fleet.status().models.items()} == running


# A full-length scenario (behind --long): the ramp's third replica starts on two cores already serving the ramp,
# ~3 minutes here, and the test runs 5–6 minutes. The mechanics are in the unit tests at seconds each:
# tests/unit/test_capacity_scheduler.py (the scheduler and a holder over HTTP), test_preemption.py (the weights).
@pytest.mark.long
@pytest.mark.timeout(1800)
def test_the_trough_is_lent_to_training_and_taken_back_at_a_ramp(settings, gateway, keys, registry, platform, fleet, dataset_id):
    # Every model keeps its replicas as its minimum (the session's other tests expect them); tab may take a third at
    # a ramp (1 req/s per replica). Four units: the three replicas of the trough and one for the trainer.
    models = [m.model_dump(mode="json") for m in settings.models]
    for m in models:
        m["capacity"] = {"min_replicas": m["replicas"]}
    models[0]["capacity"] |= {"max_replicas": 3, "rps_per_replica": 1.0}
    port, token = free_port(), admin_token(settings)
    env = {
        **os.environ,
        "TIDAL_MODELS": json.dumps(models),
        "TIDAL_CAPACITY__MODE": "tidal",
        "TIDAL_CAPACITY__TOTAL_UNITS": "4",
        "TIDAL_CAPACITY__PORT": str(port),
        "TIDAL_CAPACITY__TICK_S": "1",
        "TIDAL_CAPACITY__SCALE_DOWN_AFTER_S": "3",
        "TIDAL_CAPACITY__FORECAST__RECENT_S": "3",
        "TIDAL_CAPACITY__LEASE__HEARTBEAT_S": "1",
        "TIDAL_CAPACITY__LEASE__GRACE_S": "60",
        "TIDAL_TRAIN__PPO__MAX_ITERATIONS": "8",  # a run of its own (another key than test_ppo_train's)
    }
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
    scheduler = start_scheduler(settings, env)
    watch, ramp, train = FleetWatch(platform.fleet_client()), Ramp(gateway, keys["bob"]), None
    watch.start()
    try:
        wait_for("decision", lambda: httpx.get(f"{url}/capacity", headers=auth).json()["decided_at_ms"], 60)
        before = set(registry.versions("tab"))
        train = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "train", "tab", "--dataset", dataset_id],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        train_log = settings.log_dir / "train-tab.log"
        start = train_log.stat().st_size if train_log.exists() else 0

        def ours() -> str:
            return train_log.read_text()[start:] if train_log.exists() else ""

        wait_for("first iteration on the lease", lambda: "iteration 1/" in ours(), 300, train)
        ramp.start()
        wait_for("preemption", lambda: "stop requested; checkpointed iteration" in ours(), 120, train)
        stopped_after = int(ours().split("stop requested; checkpointed iteration ")[1].split(",")[0])
        wait_for("tab's third replica", lambda: watch.most.get("tab", 0) >= 3, 300, train)
        ramp.stop.set()
        out, _ = train.communicate(timeout=600)
        assert train.returncode == 0, out[-4000:]
        status = httpx.get(f"{url}/capacity", headers=auth).json()
    finally:
        ramp.stop.set()
        if train is not None and train.poll() is None:
            train.kill()
        scheduler.send_signal(signal.SIGKILL)  # a crash: serving must not notice
        scheduler.wait(10)
    kept = {name: len(m.replicas) for name, m in platform.fleet_client().status().models.items()}
    time.sleep(3)
    watch.stop.set()
    watch.join(10)

    # the lease: granted in the trough, revoked at the ramp, given back, granted again once the ramp was over
    kinds = [e["kind"] for e in status["events"] if e["kind"] != "scale"]
    assert kinds == ["grant", "revoke", "release", "grant", "release"], status["events"]
    revoke = next(e for e in status["events"] if e["kind"] == "revoke")
    assert "serving needs tab 3 replica(s)" in revoke["reason"]
    scales = [e["reason"] for e in status["events"] if e["kind"] == "scale"]
    assert any(r.startswith("tab: 2 -> 3 replica(s)") for r in scales) and any(r.startswith("tab: 3 -> 2") for r in scales)

    # the run: stopped behind a checkpoint of the iteration in progress, resumed from exactly there, registered once
    assert f"resuming after iteration {stopped_after - 1} of 8" in ours()  # the trainer counts from 0 there
    new = set(registry.versions("tab")) - before
    assert len(new) == 1
    info = registry.get("tab", new.pop())
    outcomes = {
        o
        for (name, run, o), _ in pushed_training(settings.prometheus.pushgateway_url, "tab").items()
        if name == "tidal_train_run_end_timestamp_seconds" and run == info.tags["tidal.train_run"]
    }
    assert outcomes == {"preempted", "finished"}

    # serving: every request answered, no model below its minimum, and nothing changed when the scheduler died
    assert ramp.errors == [] and ramp.ok > 20
    assert watch.fewest["tab"] >= 2 and watch.fewest["tabfull"] >= 1, watch.fewest
    assert {name: len(m.replicas) for name, m in platform.fleet_client().status().models.items()} == kept
    assert kept["tab"] == 2
    complete(gateway, keys["alice"], "def after_the_scheduler():\n    ", "after")
