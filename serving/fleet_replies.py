"""What the fleet supervisor's admin API answers (serving/supervisor.py), typed for its clients (serving/client.py):
the release plane, the CLI, the demo and the tests read fields, not nested dicts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ReplicaState = Literal["starting", "ready", "unhealthy", "crashed", "draining", "stopped", "failed"]


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaStatus(Reply):
    name: str = Field(description="<model>-<index>, stable across restarts.")
    state: ReplicaState = Field(description="'ready' = verified and in the gateway's rotation.")
    url: str = Field(description="Where its engine answers.")
    pid: int | None = Field(description="The engine's process (local runtime); None for a pod or before it starts.")
    base_version: int = Field(description="The full checkpoint its engine was started on.")
    served: dict[str, int] = Field(description="Served name (model@vN) -> version, of every version it serves now.")
    restarts: int
    last_error: str
    pod: str | None = Field(None, description="Kubernetes runtime: the pod it is bound to.")


class ModelStatus(Reply):
    strategy: str = Field(description="The model's weight-update strategy.")
    base_version: int
    serving_version: int = Field(description="What the gateway serves the model on while it has no routes.")
    adapters: list[int] = Field(description="LoRA versions loaded beside the base.")
    surge_versions: list[int] = Field(description="`restart`: versions on extra replicas beside the base.")
    desired_replicas: int
    replicas: list[ReplicaStatus]
    suggestion_filters: dict[int, float] = Field(
        default_factory=dict,
        description=(
            "Version -> the first-token log-prob below which the gateway withholds its completions, for each served "
            "version whose suggestion filter has a threshold (the tidal.suggestion_filter lineage tag)."
        ),
    )


class FleetState(Reply):
    """What the fleet holds (serving/fleet.py); also saved as the run directory's replicas.json, which
    `tidal status` and `tidal down` read when the supervisor is gone."""

    engine_flavor: str
    runtime: str = Field(description="'local' or 'kubernetes'.")
    models: dict[str, ModelStatus] = Field(default_factory=dict)


class FleetStatus(FleetState):
    """GET /fleet: the fleet's state and whether its start finished."""

    ready: bool = Field(description="Every configured replica started and verified.")
    error: str | None = Field(
        description="Why the fleet failed to start, if it did, or which models wait for a version to serve (and the fix)."
    )


class ScaleReply(Reply):
    model: str
    replicas: list[ReplicaStatus]


class DeployReply(Reply):
    model: str
    version: str = Field(description="The version as asked (a number or an alias).")
    probes: list[str] = Field(description="One served-weight probe summary per replica that serves it.")


class ServingReply(Reply):
    model: str
    serving_version: int


class UndeployReply(Reply):
    model: str
    version: str
    undeployed: bool
