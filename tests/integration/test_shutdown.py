"""Last of the integration session (files run in name order): `tidal down` leaves nothing running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidal.procs import group_members, port_free

pytestmark = pytest.mark.slow


def test_tidal_down_leaves_nothing_running(platform, fleet, settings):
    services = ("prefect", "mlflow", "fleet", "gateway", "flows")
    ports = {"prefect": settings.prefect.port, "mlflow": settings.mlflow.port, "fleet": settings.fleet.admin_port,
             "gateway": settings.gateway.port, "flows": settings.prefect.runner_port}
    # Before: every service runs and listens on its port, and the fleet's replicas run on theirs.
    running = {n: platform.running(n) for n in services}
    assert all(running.values()), {n: bool(i) for n, i in running.items()}
    assert [n for n, port in ports.items() if port_free("127.0.0.1", port)] == []
    replicas = [r for m in fleet.status()["models"].values() for r in m["replicas"] if r["state"] == "ready"]
    replica_ports = [int(r["url"].rsplit(":", 1)[1]) for r in replicas]
    pids = [i.pid for i in running.values()] + [r["pid"] for r in replicas]
    assert len(replicas) >= 3 and all(group_members(p) for p in pids), replicas
    assert not any(port_free("127.0.0.1", p) for p in replica_ports)

    out = subprocess.run([sys.executable, "-m", "tidal.cli", "down"], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TIDAL_CONFIG": os.environ["TIDAL_CONFIG"]})
    assert out.returncode == 0, out.stderr
    assert all(n in out.stdout for n in services), out.stdout
    # After: no process of any group (engine children included), every port free, no pid file left.
    assert [p for p in pids if group_members(p)] == []
    assert [n for n, port in ports.items() if not port_free("127.0.0.1", port)] == []
    assert [p for p in replica_ports if not port_free("127.0.0.1", p)] == []
    assert [n for n in services if platform.running(n) or (platform.run_dir / f"{n}.json").exists()] == []
