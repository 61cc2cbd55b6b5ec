"""The capacity scheduler's API records (capacity/scheduler.py serves them, capacity/client.py and `tidal status`
read them): a leaf module with no process behind it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from capacity.leases import Lease, LeaseEvent


class LeaseRequest(BaseModel):
    holder: str = Field(min_length=1, max_length=200, description="Who asks: the training run's key.")
    min_units: int = Field(1, ge=1, description="Fewer is no use: the request waits instead.")
    max_units: int | None = Field(None, ge=1, description="The most it can use; None = capacity.lease.max_units.")


class LeaseReply(BaseModel):
    granted: bool
    lease: Lease | None = Field(None, description="The lease, when granted (or already held by this holder).")
    reason: str = Field(description="Why it was granted, or why not yet.")
    retry_after_s: float = Field(0.0, description="Not granted: when to ask again.")


class ModelCapacity(BaseModel):
    replicas: int = Field(description="Replicas the fleet runs (its desired count).")
    needed: int = Field(description="Replicas the latest decision says demand needs.")
    reason: str = Field(description="Why that many.")
    forecast_rps: float
    recent_rps: float
    p99_ms: float | None


class CapacityStatus(BaseModel):
    """GET /capacity: the pool, each model's serving, the leases, and the latest events."""

    mode: str
    unit: str
    total_units: int
    usable_units: int
    serving_units: int = Field(description="Units the models' replicas take now.")
    lent_units: int = Field(description="Units held by leases (active and revoking).")
    decided_at_ms: int | None = Field(description="When the latest decision was made; None before the first.")
    last_error: str = Field("", description="Why the latest tick could not observe or act, if it could not.")
    models: dict[str, ModelCapacity]
    leases: list[Lease]
    events: list[LeaseEvent] = Field(description="The latest grants, revocations, releases, reclaims and scale decisions.")
