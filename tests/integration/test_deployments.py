"""Deployed flows: the runner registers an hourly collect and an on-demand train deployment per model."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_collect_is_deployed_on_its_schedule(platform, settings):
    info = platform.up_flows()
    assert platform.running("flows").pid == info.pid
    api = settings.prefect.api_url
    deployments = httpx.post(f"{api}/deployments/filter", json={}, timeout=30).json()
    by_name = {d["name"]: d for d in deployments}
    for m in settings.models:
        d = by_name[f"collect-{m.name}"]
        assert d["parameters"] == {"model": m.name}
        crons = [s["schedule"]["cron"] for s in d["schedules"] if s.get("active", True)]
        assert crons == [settings.collect.schedule_cron]
        flow = httpx.get(f"{api}/flows/{d['flow_id']}", timeout=30).json()
        assert flow["name"] == "collect"
        t = by_name[f"train-{m.name}"]  # on demand: no schedule
        assert t["parameters"] == {"model": m.name} and not [s for s in t["schedules"] if s.get("active", True)]
    assert httpx.get(f"http://{settings.prefect.host}:{settings.prefect.runner_port}/health", timeout=10).is_success
