"""Prefect events that chain the stages when they run as separate deployments.

    collect  ──tidal.dataset.ready──▶  train-<model>  ──tidal.candidate.registered──▶  promote-<model>

Each event names who drove the flow (`tidal.driver`): `standalone` runs (schedules, the CLI, the UI)
trigger the next stage's deployment; runs inside the flywheel flow carry `flywheel`, because the
flywheel calls the next stage itself and a trigger would start it twice.
"""

from __future__ import annotations

from typing import Literal

from prefect.events import emit_event

Driver = Literal["standalone", "flywheel"]
DATASET_READY = "tidal.dataset.ready"
CANDIDATE_REGISTERED = "tidal.candidate.registered"


def dataset_ready(model: str, dataset_id: str, rows: int, driver: Driver) -> None:
    emit_event(
        event=DATASET_READY,
        resource={"prefect.resource.id": f"tidal.dataset.{model}.{dataset_id}", "tidal.model": model, "tidal.driver": driver},
        payload={"dataset_id": dataset_id, "rows": rows},
    )


def candidate_registered(model: str, version: int, dataset_id: str, driver: Driver) -> None:
    emit_event(
        event=CANDIDATE_REGISTERED,
        resource={"prefect.resource.id": f"tidal.model-version.{model}.{version}", "tidal.model": model, "tidal.driver": driver},
        payload={"version": version, "dataset_id": dataset_id},
    )
