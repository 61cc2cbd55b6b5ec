"""Chaos: serving under faults, with simulated users typing through the real gateway all along.

1. `kill -9` a vLLM replica under load: no client-visible error (the gateway retries on the other
   replica), the fleet restarts it, every acknowledged completion and feedback stored exactly once.
2. `kill -9` the gateway under load, restart it: every acknowledged completion and feedback is in the
   object store exactly once; the only extra records are those in flight at the kill.
3. The object store down during load (a minute with --long, 15 s otherwise): serving continues, the
   WAL's early alarm fires as the cap nears, uploads resume afterwards, nothing lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from sim.audit import not_exactly_once, wait_stored
from sim.users import SimTraffic, SimUsersConfig
from tests.conftest import make_bucket
from tests.integration.tcpproxy import TcpProxy
from tidal.procs import group_members, stop_group, wait_http
from tidal.sandbox import SPARE
from tidal.store import S3Store

pytestmark = pytest.mark.slow


def users(settings, url: str, key: str, seed: int, concurrency: int = 4) -> SimTraffic:
    """Fast typists with quick verdicts: a few requests/s on two cores, most of them given feedback."""
    cfg = SimUsersConfig(
        users=50,
        sites=300,
        seed=seed,
        concurrency=concurrency,
        max_tokens=8,
        think_s=(0.0, 0.1),
        feedback_delay_s=(0.1, 0.5),
        min_chars=(1, 2),
    )
    return SimTraffic(cfg, url, key, "tab", settings.bootstrap.heldout_fraction)


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)
    return result


def finish(traffic: SimTraffic) -> None:
    traffic.stop.set()
    traffic.join(timeout=120)
    assert not traffic.is_alive(), "simulated users did not stop"  # their last verdicts are sent on the way out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def since(rows: list[dict], t0_ms: int, client_id: str) -> list[dict]:
    return [r for r in rows if r["time_ms"] >= t0_ms and r["client_id"] == client_id]


def test_replica_kill9_under_load_is_invisible_to_users(settings, gateway, keys, fleet, checkpoints, chaos_report):
    fleet.scale("tab", 2)
    wait_for("two ready tab replicas", lambda: [r.state for r in fleet.replicas("tab")] == ["ready"] * 2, 300)
    t0_ms = int(time.time() * 1000)
    traffic = users(settings, gateway, keys["alice"], seed=101)
    traffic.start()
    try:
        wait_for("20 completions before the kill", lambda: len(traffic.tally.acked) >= 20, 120)
        victim = fleet.replicas("tab")[0]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        back = wait_for(
            "the killed replica restarted and ready",
            lambda: [r for r in fleet.replicas("tab") if r.name == victim.name and r.pid != victim.pid and r.state == "ready"],
            300,
        )
        restart_s = time.monotonic() - killed
        n = len(traffic.tally.acked)
        wait_for("10 more completions with both replicas", lambda: len(traffic.tally.acked) >= n + 10, 120)
    finally:
        finish(traffic)
    tally = traffic.tally
    assert tally.errors == []  # non-streaming requests: the kill never reached a user
    assert back[0].restarts == victim.restarts + 1 and back[0].url == victim.url
    assert group_members(victim.pid) == []  # the killed engine's EngineCore and workers are gone too
    answer = httpx.post(
        back[0].url + "/v1/completions",
        timeout=60,
        json={"model": "tab@v1", "prompt": "def add(a, b):\n    return", "max_tokens": 8, "temperature": 0},
    ).json()
    assert answer["choices"][0]["text"]  # the restarted engine itself answers
    completions = since(wait_stored(checkpoints.store, "completions", set(tally.acked), 90), t0_ms, "alice")
    feedback = since(wait_stored(checkpoints.store, "feedback", set(tally.feedback_acked), 90), t0_ms, "alice")
    assert not_exactly_once(tally.acked, completions) == {}
    assert len(completions) == len(tally.acked)  # no record of a request the users never got an answer to
    assert not_exactly_once(tally.feedback_acked, feedback) == {} and len(feedback) == len(tally.feedback_acked)
    failovers = sum(
        float(line.split()[-1])
        for line in httpx.get(gateway + "/metrics").text.splitlines()
        if line.startswith("gateway_upstream_failovers_total{")
    )
    chaos_report.record(
        "1. kill -9 a vLLM replica under load",
        requests=len(tally.acked),
        client_errors=len(tally.errors),
        completions_stored=len(completions),
        feedback_acked=len(tally.feedback_acked),
        feedback_stored=len(feedback),
        replica_back_in_s=round(restart_s, 1),
        gateway_failovers_total=int(failovers),
        p99_ms=round(percentile(tally.latencies_ms, 0.99)),
    )


def test_gateway_kill9_under_load_loses_no_acknowledged_record(settings, gateway, keys, platform, checkpoints, chaos_report):
    t0_ms = int(time.time() * 1000)
    traffic = users(settings, gateway, keys["alice"], seed=102)
    traffic.start()
    try:
        wait_for("20 completions before the kill", lambda: len(traffic.tally.acked) >= 20, 120)
        routes_before = platform.routes_client().show().routes
        os.kill(platform.running("gateway").pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(1)
        platform.up_gateway()  # the WAL left behind is recovered and uploaded
        restart_s = time.monotonic() - killed
        assert platform.routes_client().show().routes == routes_before  # the split survives a restart
        n = len(traffic.tally.acked)
        wait_for("10 more completions after the restart", lambda: len(traffic.tally.acked) >= n + 10, 120)
    finally:
        finish(traffic)
    tally = traffic.tally
    completions = since(wait_stored(checkpoints.store, "completions", set(tally.acked), 90), t0_ms, "alice")
    feedback = since(wait_stored(checkpoints.store, "feedback", set(tally.feedback_acked), 90), t0_ms, "alice")
    assert not_exactly_once(tally.acked, completions) == {}
    assert not_exactly_once(tally.feedback_acked, feedback) == {}
    # Records beyond the acknowledged ones are requests in flight at the kill: logged, never answered.
    in_flight = len(completions) - len(tally.acked)
    assert 0 <= in_flight <= traffic.cfg.concurrency
    assert len({r["request_id"] for r in completions}) == len(completions)
    chaos_report.record(
        "2. kill -9 the gateway under load",
        completions_acked=len(tally.acked),
        completions_stored=len(completions),
        stored_but_unanswered=in_flight,
        feedback_acked=len(tally.feedback_acked),
        feedback_stored=len(feedback),
        client_errors_while_down=len(tally.errors),
        gateway_back_in_s=round(restart_s, 1),
    )


def test_object_store_outage_delays_uploads_but_loses_nothing(
    settings, keys, gateway, tmp_path, s3_endpoint, request, chaos_report
):
    """A second gateway logging to S3 (moto) behind a proxy that goes down mid-load."""
    outage_s = 60 if request.config.getoption("--long") else 15
    proxy_port, gw_port = settings.prefect.port + SPARE, settings.prefect.port + SPARE + 1  # the sandbox's spare ports
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]), proxy_port)
    gw = traffic = None
    try:
        proxy.start()
        make_bucket(s3_endpoint, "tidal-logs")
        store = S3Store("tidal-logs", "gw2", f"http://127.0.0.1:{proxy_port}", "us-east-1")
        config = settings.model_dump(mode="json")
        config.update(
            data_dir=str(tmp_path / "data"),
            store={"url": "s3://tidal-logs/gw2", "s3_endpoint_url": f"http://127.0.0.1:{proxy_port}"},
        )
        config["gateway"]["port"] = gw_port
        # A cap the outage's records outgrow (a completion record is ~2-4 KB): the early alarm must fire.
        config["gateway"]["logsink"].update(wal_cap_bytes=100_000, wal_warn_fraction=0.5, upload_backoff_max_s=2.0)
        (tmp_path / "tidal.yaml").write_text(yaml.safe_dump(config))
        gw = subprocess.Popen(
            [sys.executable, "-m", "serving.gateway_app"],
            env={**os.environ, "TIDAL_CONFIG": str(tmp_path / "tidal.yaml")},
            stdout=open(tmp_path / "gw.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{gw_port}"
        wait_http(url + "/health", 60, "second gateway", proc=gw, log=str(tmp_path / "gw.log"))
        time.sleep(1.5)
        traffic = users(settings, url, keys["bob"], seed=103)
        traffic.start()
        wait_for("10 completions before the outage", lambda: len(traffic.tally.acked) >= 10, 120)
        proxy.stop()  # the object store is unreachable
        during = len(traffic.tally.acked)
        peak = {"wal_near_cap": 0, "wal_pending_bytes": 0}
        deadline = time.monotonic() + outage_s
        while time.monotonic() < deadline:
            m = wal_figures(url)
            peak = {k: max(v, m[k]) for k, v in peak.items()}
            time.sleep(1)
        during = len(traffic.tally.acked) - during
        errors_during = wal_figures(url)["upload_errors_total"]
        proxy.start()
        recovered = time.monotonic()
        finish(traffic)
        tally = traffic.tally
        completions = wait_stored(store, "completions", set(tally.acked), timeout=120)
        uploaded_s = time.monotonic() - recovered
        feedback = wait_stored(store, "feedback", set(tally.feedback_acked), timeout=60)
        after = wait_for("the alarm cleared", lambda: (m := wal_figures(url))["wal_near_cap"] == 0 and m, 30)
    finally:
        if traffic is not None:
            traffic.stop.set()
        proxy.stop()
        if gw is not None:
            stop_group(gw.pid)
    assert tally.errors == []  # serving never noticed the store
    assert during > 0 and errors_during > 0
    assert peak["wal_near_cap"] == 1, peak  # the alarm fired while the store was down
    assert after["wal_over_cap"] == 0 and after["segments_pending"] == 0
    assert not_exactly_once(tally.acked, completions) == {} and len(completions) == len(tally.acked)
    assert not_exactly_once(tally.feedback_acked, feedback) == {} and len(feedback) == len(tally.feedback_acked)
    chaos_report.record(
        "3. object store down during load",
        outage_s=outage_s,
        completions_during_outage=during,
        completions_acked=len(tally.acked),
        completions_stored=len(completions),
        feedback_acked=len(tally.feedback_acked),
        feedback_stored=len(feedback),
        upload_errors=int(errors_during),
        wal_peak_pending_kb=round(peak["wal_pending_bytes"] / 1000),
        alarm_fired=bool(peak["wal_near_cap"]),
        all_uploaded_in_s=round(uploaded_s, 1),
    )


def wal_figures(url: str) -> dict[str, float]:
    """The gateway_wal{figure=...} gauges from /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('gateway_wal{figure="'):
            name, value = line.split('"')[1], float(line.split()[-1])
            out[name] = value
    return out
