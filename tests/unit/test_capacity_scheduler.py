"""The capacity scheduler (capacity/scheduler.py) over real HTTP: its API served by uvicorn on 127.0.0.1 and a
holder using capacity/client.py, against a stand-in for the platform that answers what the gateway and the
supervisor answer (the gateway's own metrics class renders /metrics, /fleet is the supervisor's reply type). Time
is the test's: each tick is given its clock.

A lease is granted in the trough, revoked at a ramp (the holder's watch stops its trainer), serving scales up only
into the units given back, and every step is an event in /capacity and a count in /metrics."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from capacity.api import LeaseRequest
from capacity.client import LeaseClient, LeaseWatch
from capacity.leases import LeaseBook
from capacity.observe import Observer
from capacity.scheduler import Scheduler, build_app
from capacity.settings import CapacitySettings
from serving.fleet_replies import FleetStatus
from serving.gateway_metrics import GatewayMetrics
from tests.unit.test_gateway_parts import fleet, replica
from tidal.model_settings import ModelSettings, ServingCapacity

TOKEN = "admin-token-0123456789"


class StandInPlatform:
    """GET /metrics as the gateway renders it, GET /fleet and POST /fleet/tab/scale as the supervisor answers."""

    def __init__(self):
        self.metrics = GatewayMetrics(dict)
        self.replicas, self.scaled = 1, []
        platform = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    return self._send(platform.metrics.render(), "text/plain")
                assert self.path == "/fleet" and self.headers["Authorization"] == f"Bearer {TOKEN}"
                state = fleet(*(replica(f"tab-{i}", "http://x", {"tab@v1": 1}) for i in range(platform.replicas)))
                self._send(FleetStatus(ready=True, error=None, **dict(state)).model_dump_json().encode())

            def do_POST(self):
                assert self.path == "/fleet/tab/scale"
                body = self.rfile.read(int(self.headers["Content-Length"]))
                platform.replicas = httpx.Response(200, content=body).json()["replicas"]
                platform.scaled.append(platform.replicas)
                self._send(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, n: int) -> None:
        for _ in range(n):
            self.metrics.observe("tab", 1, "control", 120.0, 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def running(tmp_path) -> Iterator[tuple[Scheduler, StandInPlatform, str, list[float]]]:
    platform, now = StandInPlatform(), [1_000.0]
    cfg = CapacitySettings(
        total_units=4, scale_down_after_s=0, lease={"grace_s": 30, "heartbeat_s": 5}, forecast={"recent_s": 1.0}
    )
    model = ModelSettings(name="tab", replicas=1, capacity=ServingCapacity(min_replicas=1, max_replicas=3, rps_per_replica=4))
    observer = Observer(platform.url, platform.url, TOKEN, rate_window_s=10.0)  # one tick's rate (ticks are 10 s apart)
    book = LeaseBook(tmp_path / "leases.json", cfg.lease.grace_s, cfg.lease.heartbeat_s)
    scheduler = Scheduler(cfg, [model], observer, book, clock=lambda: now[0])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(scheduler, TOKEN), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield scheduler, platform, f"http://127.0.0.1:{port}", now
    server.should_exit = True
    thread.join(5)
    platform.server.shutdown()


def tick(scheduler: Scheduler, platform: StandInPlatform, now: list[float], requests: int, seconds: float = 10.0):
    platform.serve(requests)
    now[0] += seconds
    d = scheduler.tick()
    for t in list(scheduler.scaling.values()):  # the scale call (a thread) has answered
        t.join(5)
    return d


def test_a_lease_granted_in_the_trough_is_revoked_at_the_ramp_and_serving_scales_into_what_comes_back(running):
    scheduler, platform, url, now = running
    client = LeaseClient(url, TOKEN)
    ask = LeaseRequest(holder="run-1", min_units=2, max_units=2)
    assert client.ask(ask).reason == "no decision yet: the scheduler has not observed demand"
    for _ in range(2):
        tick(scheduler, platform, now, 10)  # 1 req/s: one replica, three units free
    lease = client.acquire(ask)
    assert lease.units == 2 and lease.state == "active" and client.acquire(ask).id == lease.id  # asked again: same lease
    refused = client.ask(LeaseRequest(holder="run-2", min_units=2))
    assert not refused.granted and refused.reason.startswith("1 unit(s) free, 2 needed: serving needs tab 1 replica(s)")

    stop = threading.Event()
    with LeaseWatch(client, lease, stop, heartbeat_s=0.05) as watch:
        d = tick(scheduler, platform, now, 100)  # 10 req/s x 1.25 / 4 per replica: 4, capped at 3
        assert d.needed == {"tab": 3} and [x.id for x, _ in d.revoke] == [lease.id]
        assert platform.scaled == [2]  # one unit is free now; the lease's two come back once it is released
        assert stop.wait(5) and "serving needs tab 3 replica(s)" in watch.revoked
    client.release(lease.id)
    tick(scheduler, platform, now, 100)
    assert platform.scaled == [2, 3] and scheduler.book.held() == []

    status = httpx.get(f"{url}/capacity", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert [e["kind"] for e in status["events"]] == ["grant", "revoke", "scale", "release", "scale"]
    assert status["models"]["tab"]["needed"] == 3 and status["lent_units"] == 0 and status["serving_units"] == 3
    assert httpx.get(f"{url}/capacity").status_code == 401  # the admin token guards everything but health and metrics
    metrics = httpx.get(f"{url}/metrics").text
    assert 'capacity_units{holder="serving"} 3.0' in metrics and 'capacity_events_total{kind="revoke"} 1.0' in metrics


def test_a_holder_silent_past_its_heartbeats_is_reclaimed_and_learns_it(running):
    scheduler, platform, url, now = running
    client = LeaseClient(url, TOKEN)
    for _ in range(2):
        tick(scheduler, platform, now, 10)
    lease = client.acquire(LeaseRequest(holder="run-1", min_units=1, max_units=1))
    tick(scheduler, platform, now, 10, seconds=25.0)  # 25 s > 4 heartbeats of 5 s without one
    gone = client.heartbeat(lease.id)
    assert gone is not None and gone.state == "reclaimed" and "no heartbeat for" in gone.reason
    assert client.heartbeat("lease-unknown") is None


def test_an_unreachable_platform_changes_nothing(running):
    scheduler, platform, url, now = running
    for _ in range(2):
        tick(scheduler, platform, now, 10)
    platform.server.shutdown()
    platform.server.server_close()
    assert tick(scheduler, platform, now, 0) is None
    assert scheduler.last_error.startswith(f"cannot observe the platform (GET {platform.url}/metrics): ")
    assert platform.scaled == [] and scheduler.decision is not None  # the previous decision stands, nothing scaled


def test_a_training_run_waits_for_a_lease_is_preempted_at_the_ramp_and_resumes_on_the_next(running, tmp_path):
    """The train task's loop (tasks/train.py) with the local launcher running a stand-in trainer that stops at
    SIGTERM as training.job does (tests/unit/test_preemption.py proves the weights)."""
    from tasks.train import LeaseTerms, TrainPlan, _train_on_leases
    from tests.unit.trainer_fixtures import RESUMES, StandIn, spec
    from training.train_settings import LaunchSettings

    scheduler, platform, url, now = running
    for _ in range(2):
        tick(scheduler, platform, now, 10)  # the trough
    plan = TrainPlan(spec(), None, None, tmp_path / "spec.json", tmp_path / "train.log", LaunchSettings())
    said, out = [], []
    terms = LeaseTerms(url, TOKEN, units=2, grace_s=5.0, heartbeat_s=0.05)
    run = threading.Thread(
        target=lambda: out.append(_train_on_leases(plan, None, terms, said.append, launcher=StandIn(RESUMES))), daemon=True
    )
    run.start()
    ready = tmp_path / "ready"
    while not ready.exists():
        time.sleep(0.02)
    tick(scheduler, platform, now, 100)  # the ramp: the lease is revoked, the trainer stopped
    while not any("preempted" in line for line in said):
        assert run.is_alive(), said
        time.sleep(0.02)
    time.sleep(0.3)
    assert (
        run.is_alive() and "waiting for a lease: 0 unit(s) free, 2 needed: serving needs tab 3" in said[-1]
    )  # the peak: it waits
    tick(scheduler, platform, now, 5)  # the trough again: one replica, the lease granted, the run resumes
    run.join(30)
    assert out == [1] and "finished" in plan.log_path.read_text()
    kinds = [e.kind for e in scheduler.book.events]
    assert kinds[: kinds.index("revoke") + 1] == ["grant", "revoke"] and kinds.count("grant") == 2
    assert kinds.count("release") == 2 and scheduler.book.held() == []
