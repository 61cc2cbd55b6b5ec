"""Flow runs a dead runner left behind: when the runner starts, each is marked Crashed and submitted again.

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
                flow_run_filter=FlowRunFilter(state={"type": {"any_": [StateType.RUNNING, StateType.PENDING]}}))
            for run in runs:
                client.set_flow_run_state(run.id, Crashed(message="its runner died; resubmitted when a runner started again"),
                                          force=True)
                if name.split("/")[0] in RESTARTS_RELEASES:
                    _roll_back_canary(settings, run.parameters.get("model", ""), run.name)
                new = client.create_flow_run_from_deployment(dep.id, parameters=run.parameters,
                                                             tags=sorted({*run.tags, RESUMED_TAG}))
                log.warning("flow run %s of %s was orphaned by a dead runner: marked Crashed, resubmitted as %s",
                            run.name, name, new.name)
                out.append({"deployment": name, "crashed": str(run.id), "resubmitted": str(new.id)})
    return out


def _roll_back_canary(settings: TidalSettings, model: str, run_name: str) -> None:
    from serving.client import RoutesClient
    from tasks.promote import canary_arm
    from tidal.tokens import admin_token

    routes = RoutesClient(f"http://{settings.gateway.host}:{settings.gateway.port}", admin_token(settings))
    try:
        if canary_arm(routes, model) is not None:
            routes.rollback(model, by="runner", reason=f"release run {run_name} was orphaned by a dead runner")
    except Exception as e:  # noqa: BLE001  the gateway may be down too: said loudly, for `tidal rollback`
        log.error("could not roll back %s's canary of orphaned run %s (%s): run `tidal rollback %s`", model, run_name, e, model)
