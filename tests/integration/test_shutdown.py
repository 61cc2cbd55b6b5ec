"""Last of the integration session (marked stops_the_platform, which the suite sorts last): no credential in anything
the session's platform wrote or answered, then `tidal down` leaves nothing running."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import httpx
import pytest

from serving.upstream import ReplicaPool
from tidal.procs import group_members, port_free

pytestmark = [pytest.mark.slow, pytest.mark.stops_the_platform]


def _secrets(settings) -> dict[str, str]:
    """Every credential of the platform: configured ones and those generated into data_dir/secrets."""
    found = {
        "admin_token": settings.admin_token or "",
        "gateway.secret": settings.gateway.secret or "",
        **{f"client key {c.client_id}": c.key for c in settings.gateway.clients},
    }
    for path in (settings.data_path / "secrets").glob("*"):
        found[f"secrets/{path.name}"] = path.read_text().strip()
    return {name: value for name, value in found.items() if len(value) >= 8}


def _prefect_logs(settings) -> str:
    lines, offset = [], 0
    while True:
        page = httpx.post(f"{settings.prefect.api_url}/logs/filter", json={"limit": 200, "offset": offset}, timeout=30)
        page.raise_for_status()
        lines += [log["message"] for log in page.json()]
        if len(page.json()) < 200:
            return "\n".join(lines)
        offset += 200


def _mlflow_records(settings) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(settings.mlflow.tracking_uri)
    parts = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            parts += [f"{k}={v}" for k, v in {**run.data.params, **run.data.tags}.items()]
    for mv in client.search_model_versions(max_results=1000):
        parts += [f"{k}={v}" for k, v in mv.tags.items()] + [mv.description or ""]
    return "\n".join(parts)


def test_no_credential_in_any_log_reply_metric_or_mlflow_record(platform, fleet, gateway, settings):
    """After the whole session, and after the supervisor refused a poll (a ClientResponseError's repr carries
    the Authorization header it was sent with): no secret in a log file, a health or metrics reply, a Prefect
    log or an MLflow parameter, tag or description."""

    async def refused_poll() -> str:
        pool = ReplicaPool(f"http://127.0.0.1:{settings.fleet.admin_port}", "wrong-admin-token-0123456789", poll_s=0.05)
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(pool.run(session))
            await asyncio.sleep(0.3)
            task.cancel()
        return pool.last_error

    refused = asyncio.run(refused_poll())
    assert "HTTP 401" in refused and "wrong-admin-token" not in refused, refused

    secrets = {**_secrets(settings), "the refused poll's token": "wrong-admin-token-0123456789"}
    assert {"admin_token", "gateway.secret", "client key alice"} <= set(secrets)
    texts = {
        str(p.relative_to(settings.data_path)): p.read_text(errors="replace")
        for p in Path(settings.data_path).rglob("*.log")
        if p.is_file()
    }
    assert any(name.endswith("gateway.log") for name in texts) and any(name.endswith("fleet.log") for name in texts)
    texts["the refused poll"] = refused
    pushed = f"{settings.prometheus.pushgateway_url}/metrics"  # what the session's trainers pushed
    for url in (f"{gateway}/health", f"{gateway}/metrics", f"http://127.0.0.1:{settings.fleet.admin_port}/health", pushed):
        texts[url] = httpx.get(url, timeout=10).text
    texts["prefect logs"] = _prefect_logs(settings)
    texts["mlflow params, tags, descriptions"] = _mlflow_records(settings)
    assert texts["mlflow params, tags, descriptions"] and texts["prefect logs"]
    leaks = [(source, name) for source, text in texts.items() for name, value in secrets.items() if value in text]
    assert leaks == [], leaks


def test_tidal_down_leaves_nothing_running(platform, fleet, settings):
    services = ("prefect", "mlflow", "fleet", "gateway", "flows")
    ports = {
        "prefect": settings.prefect.port,
        "mlflow": settings.mlflow.port,
        "fleet": settings.fleet.admin_port,
        "gateway": settings.gateway.port,
        "flows": settings.prefect.runner_port,
    }
    # Before: every service runs and listens on its port, and the fleet's replicas run on theirs.
    running = {n: platform.running(n) for n in services}
    assert all(running.values()), {n: bool(i) for n, i in running.items()}
    assert [n for n, port in ports.items() if port_free("127.0.0.1", port)] == []
    replicas = [r for m in fleet.status().models.values() for r in m.replicas if r.state == "ready"]
    replica_ports = [int(r.url.rsplit(":", 1)[1]) for r in replicas]
    pids = [i.pid for i in running.values()] + [r.pid for r in replicas]
    assert len(replicas) >= 3 and all(group_members(p) for p in pids), replicas
    assert not any(port_free("127.0.0.1", p) for p in replica_ports)

    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "down"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TIDAL_CONFIG": os.environ["TIDAL_CONFIG"]},
    )
    assert out.returncode == 0, out.stderr
    assert all(n in out.stdout for n in services), out.stdout
    # After: no process of any group (engine children included), every port free, no pid file left.
    assert [p for p in pids if group_members(p)] == []
    assert [n for n, port in ports.items() if not port_free("127.0.0.1", port)] == []
    assert [p for p in replica_ports if not port_free("127.0.0.1", p)] == []
    assert [n for n in services if platform.running(n) or (platform.run_dir / f"{n}.json").exists()] == []
