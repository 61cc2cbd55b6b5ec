"""Last of the integration session (files run in name order): `tidal down` leaves nothing running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidal.procs import group_members, port_free

pytestmark = pytest.mark.slow


def test_tidal_down_leaves_nothing_running(platform, fleet, settings):
    pids = [platform.running(n).pid for n in ("prefect", "mlflow", "fleet", "gateway", "flows") if platform.running(n)]
    pids += platform.replica_pids()
    assert len(pids) >= 5
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "down"], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TIDAL_CONFIG": os.environ["TIDAL_CONFIG"]})
    assert out.returncode == 0, out.stderr
    assert "fleet" in out.stdout and "mlflow" in out.stdout and "prefect" in out.stdout
    assert [p for p in pids if group_members(p)] == []  # no process of any group, engine children included
    for port in (settings.prefect.port, settings.mlflow.port, settings.fleet.admin_port, settings.gateway.port,
                 settings.prefect.runner_port):
        assert port_free("127.0.0.1", port)
