"""Deployed flows: per model, collect on its schedule, train and promote chained by events, the flywheel on demand."""

from __future__ import annotations

import time

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
            (settings.flywheel.schedule_cron, settings.flywheel.loop == "flywheel")
        ]
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
        judge = by_name.get(f"judge-{m.name}")  # models with a judge: on demand (no schedule_cron in the session)
        assert (judge is not None) == (m.judge is not None)
        if judge is not None:
            assert judge["parameters"] == {"model": m.name} and not judge["schedules"]
    assert httpx.get(f"http://{settings.prefect.host}:{settings.prefect.runner_port}/health", timeout=10).is_success


def test_runs_a_dead_runner_left_running_are_crashed_and_resubmitted(platform, settings):
    """A run the previous runner held (here forced to Running, as a runner killed mid-flow leaves it) is marked
    Crashed by the next runner at start-up and submitted again, with the same parameters; the new run finishes.
    (`collect-tabfull`: quick to redo, and no other test collects that model's logs.) The real kill -9 of a
    runner mid-training is tests/integration/test_ppo_train.py, under --long."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.deployments import run_deployment
    from prefect.states import Running

    from tasks.resume import RESUMED_TAG

    platform.up_flows()
    platform.stop("flows")  # nothing executes the run below until a runner starts again
    orphan = run_deployment(name="collect/collect-tabfull", parameters={"model": "tabfull", "include_open_hour": True}, timeout=0)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(orphan.id, Running(), force=True)
        platform.up_flows()
        deadline = time.monotonic() + 300
        while True:
            resumed = [
                r
                for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(tags={"all_": [RESUMED_TAG]}))
                if r.parameters == orphan.parameters
            ]
            if resumed and resumed[0].state.is_final():
                break
            assert time.monotonic() < deadline, [(r.name, r.state.name) for r in resumed]
            time.sleep(1)
        assert client.read_flow_run(orphan.id).state.name == "Crashed"
    assert len(resumed) == 1 and resumed[0].state.name == "Completed", resumed[0].state
    assert (resumed[0].deployment_id, resumed[0].parameters) == (orphan.deployment_id, orphan.parameters)


def test_with_a_work_pool_the_deployments_are_registered_there_with_image_and_accounts(platform, settings):
    """flywheel.work_pool: the same deployments go to a Kubernetes work pool (Tidal's job template) with the image
    and each stage's service account as job variables. Registered under a model of their own ('pooltest'), so
    the session's runner and its deployments are untouched, and removed after."""
    import json
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.deployments import deployments, register_on_pool

    template = json.loads((Path(__file__).parents[2] / "infra" / "prefect" / "kubernetes-work-pool.json").read_text())
    pool, image = "tidal-kubernetes-test", "registry.example/tidal:1.2.3"
    s = settings.model_copy(
        update={
            "models": [settings.models[0].model_copy(update={"name": "pooltest"})],
            "flywheel": settings.flywheel.model_copy(update={"work_pool": pool, "image": image}),
        }
    )
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="kubernetes", base_job_template=template), overwrite=True)
        try:
            ids = register_on_pool(s, deployments(s))
            assert len(ids) == 6
            got = {d.name: d for d in (client.read_deployment(i) for i in ids)}
            stages = ("collect", "train", "promote", "flywheel", "rollout", "judge")  # tab's copy has a judge
            assert set(got) == {f"{stage}-pooltest" for stage in stages}
            for name, d in got.items():
                assert d.work_pool_name == pool and d.job_variables["image"] == image, name
                train = name.startswith("train-")
                assert d.job_variables["service_account_name"] == ("tidal-trainer" if train else "tidal-flows")
                assert d.job_variables["automount_service_account_token"] is train
            assert got["collect-pooltest"].parameters == {"model": "pooltest"}
        finally:
            for d in client.read_deployments():
                if d.name.endswith("-pooltest"):
                    client.delete_deployment(d.id)
            client.delete_work_pool(pool)
