"""Deployed flows: per model, collect on its schedule, train and promote chained by events, the flywheel on demand."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_deployments_are_registered_per_model(platform, settings):
    info = platform.up_flows()
    assert platform.running("flows").pid == info.pid
    api = settings.prefect.api_url
    deployments = httpx.post(f"{api}/deployments/filter", json={}, timeout=30).json()
    by_name = {d["name"]: d for d in deployments}
    for m in settings.models:
        d = by_name[f"collect-{m.name}"]
        assert d["parameters"] == {"model": m.name}
        crons = [s["schedule"]["cron"] for s in d["schedules"] if s.get("active", True)]
        assert [s["schedule"]["cron"] for s in d["schedules"]] == [settings.collect.schedule_cron]
        assert crons == ([settings.collect.schedule_cron] if settings.flywheel.loop == "chained" else [])
        flow = httpx.get(f"{api}/flows/{d['flow_id']}", timeout=30).json()
        assert flow["name"] == "collect"
        fly = by_name[f"flywheel-{m.name}"]  # the whole cycle: on demand ('chained' loop by default)
        assert [(s["schedule"]["cron"], s["active"]) for s in fly["schedules"]] == [
            (settings.flywheel.schedule_cron, settings.flywheel.loop == "flywheel")]
        for stage, event in (("train", "tidal.dataset.ready"), ("promote", "tidal.candidate.registered")):
            t = by_name[f"{stage}-{m.name}"]  # started by the previous stage's event, or on demand
            assert t["parameters"] == {"model": m.name} and not [s for s in t["schedules"] if s.get("active", True)]
            assert t["concurrency_limit"] == 1 or t.get("global_concurrency_limit", {}).get("limit") == 1
            automations = httpx.get(f"{api}/automations/related-to/prefect.deployment.{t['id']}", timeout=30)
            triggers = [a["trigger"] for a in automations.json()] if automations.is_success else []
            match = [{k: v if isinstance(v, list) else [v] for k, v in tr["match"].items()} for tr in triggers]
            assert [tr["expect"] for tr in triggers] == [[event]], automations.text
            assert match == [{"tidal.model": [m.name], "tidal.driver": ["standalone"]}], automations.text
            # the session runs loop 'manual' (tests drive the stages): triggers registered, not enabled
            assert [a["enabled"] for a in automations.json()] == [settings.flywheel.loop == "chained"]
    assert httpx.get(f"http://{settings.prefect.host}:{settings.prefect.runner_port}/health", timeout=10).is_success
