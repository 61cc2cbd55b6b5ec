"""What the flows' runner does when it starts, before it serves: flow runs a dead runner left behind are marked
Crashed and submitted again, and each model's live state is reconciled with the gateway's routes.

The runner (`python -m flows.deployments`) is the only executor of this platform's deployments, so a run
of one of them still Running or Pending when a runner starts was orphaned by the previous runner's death
(kill -9, out of memory, a node lost): nothing would ever finish it, and its deployment's concurrency slot
would stay taken. Every flow here is safe to run again:
  collect   redone under the same dataset id (the watermark moves only once a dataset is complete)
  train     the trainer resumes from its last checkpoint in the object store; a candidate already
            registered for the same run is found, not registered twice
  promote,  the model's canary, if one is routed, is rolled back first (no release may keep users on a
  flywheel  ramp nobody watches), then the release starts over
"""

from __future__ import annotations

import logging

from tidal.settings import TidalSettings

log = logging.getLogger("tidal.flows")

RESUMED_TAG = "tidal-resumed"
RESTARTS_RELEASES = ("promote", "flywheel")  # flows that move traffic: their canary is rolled back first


def resume_orphaned_runs(settings: TidalSettings, deployment_names: list[str]) -> list[dict]:
    """deployment_names: 'flow/deployment'. Returns one {crashed, resubmitted, deployment} per orphaned run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    out = []
    with get_client(sync_client=True) as client:
        for name in deployment_names:
            try:
                dep = client.read_deployment_by_name(name)
            except ObjectNotFound:  # first start: not registered yet, so nothing of it can be running
                continue
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id={"any_": [dep.id]}),
                flow_run_filter=FlowRunFilter(state={"type": {"any_": [StateType.RUNNING, StateType.PENDING]}}),
            )
            for run in runs:
                client.set_flow_run_state(
                    run.id, Crashed(message="its runner died; resubmitted when a runner started again"), force=True
                )
                if name.split("/")[0] in RESTARTS_RELEASES:
                    _roll_back_canary(settings, run.parameters.get("model", ""), run.name)
                new = client.create_flow_run_from_deployment(
                    dep.id, parameters=run.parameters, tags=sorted({*run.tags, RESUMED_TAG})
                )
                log.warning(
                    "flow run %s of %s was orphaned by a dead runner: marked Crashed, resubmitted as %s", run.name, name, new.name
                )
                out.append({"deployment": name, "crashed": str(run.id), "resubmitted": str(new.id)})
    return out


def _roll_back_canary(settings: TidalSettings, model: str, run_name: str) -> None:
    from release.operations import roll_back_canary
    from serving.client import routes_client

    try:
        roll_back_canary(
            routes_client(settings), model, by="runner", reason=f"release run {run_name} was orphaned by a dead runner"
        )
    except Exception as e:  # noqa: BLE001  the gateway may be down too: said loudly, for `tidal rollback`
        log.error("could not roll back %s's canary of orphaned run %s (%s): run `tidal rollback %s`", model, run_name, e, model)


def reconcile_live_state(settings: TidalSettings) -> list[dict]:
    """At the runner's start: each model's champion alias and fleet serving version made to follow the gateway's
    routes (release/live_state.py), so no release starts from records a crash left disagreeing. A model that cannot
    be reconciled now (a server down) is logged; its next release reconciles it again before it starts."""
    from release.live_state import reconcile
    from serving.client import fleet_client, routes_client
    from tidal.registry import Registry

    registry, out = Registry(settings.mlflow.tracking_uri), []
    routes, fleet = routes_client(settings), fleet_client(settings, timeout_s=30.0)
    for m in settings.models:
        try:
            live = reconcile(m.name, registry, routes, fleet, by="runner")
        except Exception as e:  # noqa: BLE001  reported; the release reconciles again
            log.error("could not reconcile %s's live state at start (%s: %s)", m.name, type(e).__name__, str(e)[:200])
            continue
        for fix in live.fixed:
            log.warning("%s: reconciled %s", m.name, fix)
        out.append(live.model_dump())
    return out
