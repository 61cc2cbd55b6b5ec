"""Scheduled flows: `python -m flows.deployments` registers the deployments with the Prefect server and
runs them when due (a Prefect runner: the local counterpart of a worker on a work pool).

Per configured model: `collect-<model>` on its cron schedule, and `train-<model>` on demand (from the UI,
`prefect deployment run train/train-<model>`, or the flywheel).
"""

from __future__ import annotations

import os

from tidal.settings import TidalSettings, load_settings


def deployments(settings: TidalSettings) -> list:
    from flows.collect import (
        collect,  # Prefect reads its API URL on import: after the environment is set
    )
    from flows.train import train

    c = settings.collect
    out = []
    for m in settings.models:
        out.append(collect.to_deployment(name=f"collect-{m.name}", cron=c.schedule_cron, parameters={"model": m.name},
                                         description=f"Validate {m.name}'s new logs into a reward dataset.", tags=["tidal", m.name]))
        out.append(train.to_deployment(name=f"train-{m.name}", parameters={"model": m.name}, tags=["tidal", m.name],
                                       description=f"PPO from {m.name}'s champion on its latest dataset; gated candidate."))
    return out


def main() -> None:
    settings = load_settings()
    from tidal.platform import prefect_env

    os.environ.update(prefect_env(settings))
    os.environ.update({"PREFECT_RUNNER_SERVER_ENABLE": "true", "PREFECT_RUNNER_SERVER_HOST": settings.prefect.host,
                       "PREFECT_RUNNER_SERVER_PORT": str(settings.prefect.runner_port)})
    from prefect import serve

    serve(*deployments(settings), print_starting_message=False)


if __name__ == "__main__":
    main()
