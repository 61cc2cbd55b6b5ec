"""Scheduled flows: `python -m flows.deployments` registers the deployments with the Prefect server and
runs them when due (a Prefect runner: the local counterpart of a worker on a work pool).

Per configured model (`flywheel.loop` picks which schedule and triggers are active):
  collect-<model>   on its cron schedule ('chained')
  train-<model>     on each `tidal.dataset.ready` event of a standalone collect ('chained'), or on demand
  promote-<model>   on each `tidal.candidate.registered` event of a standalone train ('chained'), or on demand
  flywheel-<model>  whole cycles on its cron schedule ('flywheel'), or on demand
  rollout-<model>   a champion alias moved by hand in the registry (release/webhook_app.py), or on demand
  judge-<model>     models with a judge: on its cron schedule (models[].judge.schedule_cron), or on demand
On demand: the UI, `prefect deployment run <flow>/<deployment>`, or the `tidal` commands.

With `flywheel.work_pool` set, the same deployments are registered on that work pool (the image and each
stage's service account as job variables) and the command exits: the pool's workers run them.
"""

from __future__ import annotations

import os

from tidal.settings import TidalSettings, load_settings

STAGES = ("collect", "train", "promote", "flywheel")  # the flywheel's: `tidal pause` pauses these


def deployment_name(stage: str, model: str) -> str:
    return f"{stage}-{model}"


def deployment_names(model: str) -> list[str]:
    """`flow/deployment` names of the model's stages (what `tidal pause` pauses in Prefect)."""
    return [f"{stage}/{deployment_name(stage, model)}" for stage in STAGES]


def deployments(settings: TidalSettings) -> list:
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    from flows.collect import collect  # Prefect reads its API URL on import: after the environment is set
    from flows.flywheel import flywheel
    from flows.judge import judge
    from flows.promote import promote
    from flows.rollout import rollout
    from flows.train import train
    from tasks.events import CANDIDATE_REGISTERED, DATASET_READY
    from tidal.flywheel_pause import paused
    from tidal.store import open_store

    chained, cycles = settings.flywheel.loop == "chained", settings.flywheel.loop == "flywheel"
    store, out = open_store(settings), []
    for m in settings.models:
        name, tags = m.name, ["tidal", m.name]
        held = paused(store, name) is not None  # a restarted runner keeps a `tidal pause` in force
        # Standalone runs chain by events; runs inside the flywheel carry driver=flywheel and trigger nothing.
        on = {"tidal.model": name, "tidal.driver": "standalone"}
        out += [
            collect.to_deployment(
                name=deployment_name("collect", name),
                schedules=[Cron(settings.collect.schedule_cron, timezone="UTC", active=chained)],
                tags=tags,
                paused=held,
                parameters={"model": name},
                description=f"Validate {name}'s new logs into a reward dataset.",
            ),
            train.to_deployment(
                name=deployment_name("train", name),
                parameters={"model": name},
                tags=tags,
                paused=held,
                concurrency_limit=1,
                description=f"PPO from {name}'s champion on a dataset; gated candidate.",
                triggers=[
                    DeploymentEventTrigger(
                        name=f"{name}: dataset ready",
                        expect={DATASET_READY},
                        match=on,
                        enabled=chained,
                        parameters={"model": name, "dataset_id": "{{ event.payload.dataset_id }}"},
                    )
                ],
            ),
            promote.to_deployment(
                name=deployment_name("promote", name),
                parameters={"model": name},
                tags=tags,
                paused=held,
                concurrency_limit=1,
                description=f"Canary A/B of {name}'s candidate; promote or roll back.",
                triggers=[
                    DeploymentEventTrigger(
                        name=f"{name}: candidate registered",
                        expect={CANDIDATE_REGISTERED},
                        match=on,
                        enabled=chained,
                        parameters={"model": name, "candidate": "{{ event.payload.version }}"},
                    )
                ],
            ),
            flywheel.to_deployment(
                name=deployment_name("flywheel", name),
                schedules=[Cron(settings.flywheel.schedule_cron, timezone="UTC", active=cycles)],
                parameters={"model": name},
                tags=tags,
                paused=held,
                concurrency_limit=1,
                description=f"One whole cycle for {name}: collect → train → promote.",
            ),
            rollout.to_deployment(
                name=deployment_name("rollout", name),
                parameters={"model": name},
                tags=tags,
                concurrency_limit=1,  # never paused: an operator's move, like `tidal rollback`
                description=f"Serve the version {name}'s champion alias was moved to by hand (registry webhook).",
            ),
        ]
        if m.judge is not None:  # its scores reach the next collection when the judge runs before it
            schedules = [Cron(m.judge.schedule_cron, timezone="UTC")] if m.judge.schedule_cron else []
            out.append(
                judge.to_deployment(
                    name=deployment_name("judge", name),
                    schedules=schedules,
                    parameters={"model": name},
                    tags=tags,
                    concurrency_limit=1,
                    description=f"Score {name}'s logged completions with its judge {m.judge.id}.",
                )
            )
    return out


def job_variables(settings: TidalSettings, deployment_name: str) -> dict:
    """A work-pool run's job variables: train runs get the trainer's account and an API token (the train flow
    creates the trainer Job), every other stage the flows' account and no token."""
    f = settings.flywheel
    if deployment_name.startswith("train-"):
        return {"service_account_name": f.trainer_service_account, "automount_service_account_token": True}
    return {"service_account_name": f.flows_service_account, "automount_service_account_token": False}


def register_on_pool(settings: TidalSettings, deps: list) -> list:
    """Register `deps` on settings.flywheel.work_pool; returns their ids."""
    from prefect import deploy

    for d in deps:
        d.job_variables = {**(d.job_variables or {}), **job_variables(settings, d.name)}
    return deploy(
        *deps,
        work_pool_name=settings.flywheel.work_pool,
        image=settings.flywheel.image,
        build=False,
        push=False,
        print_next_steps_message=False,
    )


def main() -> None:
    settings = load_settings()
    from tidal.client_env import mlflow_env, prefect_env

    os.environ.update({**prefect_env(settings), **mlflow_env(settings)})  # the flows' clients, remote servers included
    os.environ.update(
        {
            "PREFECT_RUNNER_SERVER_ENABLE": "true",
            "PREFECT_RUNNER_SERVER_HOST": settings.prefect.host,
            "PREFECT_RUNNER_SERVER_PORT": str(settings.prefect.runner_port),
        }
    )
    from prefect import serve

    from tasks.resume import reconcile_live_state, resume_orphaned_runs

    deps = deployments(settings)
    if settings.flywheel.work_pool:
        ids = register_on_pool(settings, deps)
        print(f"registered {len(ids)} deployments on work pool {settings.flywheel.work_pool!r}; its workers run them")
        return
    resume_orphaned_runs(settings, [f"{d.flow_name}/{d.name}" for d in deps])  # before serving: the runner picks them up
    reconcile_live_state(settings)  # after orphaned canaries are rolled back, before any release runs
    serve(*deps, print_starting_message=False, query_seconds=settings.flywheel.runner_poll_s)


if __name__ == "__main__":
    main()
