"""Scheduled flows: `python -m flows.deployments` registers the deployments with the Prefect server and
runs them when due (a Prefect runner: the local counterpart of a worker on a work pool).

Today: `collect-<model>`, hourly, per configured model.
"""

from __future__ import annotations

import os

from tidal.settings import TidalSettings, load_settings


def deployments(settings: TidalSettings) -> list:
    from flows.collect import collect  # Prefect reads its API URL on import: after the environment is set

    c = settings.collect
    return [collect.to_deployment(name=f"collect-{m.name}", cron=c.schedule_cron, parameters={"model": m.name},
                                  description=f"Validate {m.name}'s new logs into a reward dataset.", tags=["tidal", m.name])
            for m in settings.models]


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
