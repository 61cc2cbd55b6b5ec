"""The capacity scheduler's settings (`capacity:` in tidal.yaml): what a unit of capacity is, how many there are, how
a lease behaves, and how demand is forecast. Each model's bounds are `models[].capacity` (tidal/model_settings.py)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from tidal.model_settings import ModelSettings
from tidal.section import Section


class LeaseSettings(Section):
    min_units: int = Field(1, ge=1, description="A lease smaller than this is not worth a trainer start: not granted.")
    max_units: int | None = Field(None, ge=1, description="The most one lease holds; None = whatever is free.")
    grace_s: float = Field(
        60.0,
        gt=0,
        description=(
            "After a revocation the holder has this long to give the units back (the trainer checkpoints the iteration in "
            "progress and exits); then it is killed and the units count as serving's. Longer than one training iteration."
        ),
    )
    heartbeat_s: float = Field(
        15.0,
        gt=0,
        description="A holder renews its lease this often; a lease not renewed for 4 periods is reclaimed (its holder died).",
    )


class ForecastSettings(Section):
    day_s: float = Field(
        86400.0,
        gt=0,
        description="The length of a day of traffic: 86400 in production; the simulated users compress it (sim/users.py).",
    )
    recent_s: float = Field(300.0, gt=0, description="The recent average is an exponential one with this time constant.")
    rate_window_s: float = Field(
        15.0,
        gt=0,
        le=60,
        description=(
            "Each observation is the request rate over this window (at least one tick; at most the minute of gateway "
            "scrapes the scheduler keeps): at a few requests per second the count of one tick is mostly noise, which "
            "could revoke a lease on a burst or hold a replica no longer needed."
        ),
    )
    yesterday_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "How much the same time of the previous day counts against the recent average (once a day of history "
            "exists). The forecast is never below the recent average: a ramp the previous day did not have is still seen."
        ),
    )
    lookahead_s: float = Field(
        600.0,
        ge=0,
        description=(
            "How far ahead serving is sized: at least a replica's start plus the lease grace period, so that capacity "
            "is back before the demand the forecast sees arrives."
        ),
    )


class CapacitySettings(Section):
    mode: Literal["static", "tidal"] = Field(
        "static",
        description=(
            "'static': every model keeps its `replicas` and the trainer runs whenever a flow starts it (no leases). "
            "'tidal': the scheduler sizes serving to demand within each model's capacity bounds and lends the rest of "
            "the pool to training as leases, revoked before the peak."
        ),
    )
    unit: Literal["core", "gpu", "node"] = Field(
        "core", description="What a unit of the pool is: a CPU core locally, a GPU or a node on Kubernetes."
    )
    total_units: int = Field(
        default_factory=lambda: os.cpu_count() or 1, ge=1, description="Units in the pool (default: this machine's cores)."
    )
    reserved_units: int = Field(
        0, ge=0, description="Units neither serving nor training gets (the gateway, the control planes' own processes)."
    )
    units_per_replica: int = Field(1, ge=1, description="Units one serving replica takes.")
    scale_down_after_s: float = Field(
        300.0, ge=0, description="A model keeps a replica it no longer needs this long before giving it up (no flapping)."
    )
    tick_s: float = Field(5.0, gt=0, description="Seconds between two decisions.")
    host: str = Field("127.0.0.1", description="Address the scheduler's API binds to.")
    port: int = Field(8095, ge=1, le=65535, description="Port of the scheduler's API (leases, status, /metrics).")
    lease: LeaseSettings = Field(default_factory=LeaseSettings, description="How a training lease behaves.")
    forecast: ForecastSettings = Field(default_factory=ForecastSettings, description="How demand is forecast.")

    @model_validator(mode="after")
    def _check(self) -> CapacitySettings:
        if self.reserved_units >= self.total_units:
            raise ValueError(
                f"capacity.reserved_units={self.reserved_units} leaves nothing of capacity.total_units={self.total_units}: "
                "lower reserved_units or raise total_units"
            )
        if self.lease.grace_s <= self.lease.heartbeat_s:
            raise ValueError(
                f"capacity.lease.grace_s={self.lease.grace_s:g} is not above capacity.lease.heartbeat_s="
                f"{self.lease.heartbeat_s:g}: a holder learns of a revocation at its next heartbeat, so it could be killed "
                "before it knew; raise grace_s above heartbeat_s plus one training iteration"
            )
        if self.lease.max_units is not None and self.lease.max_units < self.lease.min_units:
            raise ValueError(
                f"capacity.lease.max_units={self.lease.max_units} is below capacity.lease.min_units="
                f"{self.lease.min_units}: no lease could ever be granted; raise max_units or lower min_units"
            )
        return self

    @property
    def usable_units(self) -> int:
        """Units serving and training share."""
        return self.total_units - self.reserved_units


def capacity_problems(cap: CapacitySettings, models: list[ModelSettings]) -> list[str]:
    """Under `mode: tidal`, each model's bounds and the pool must leave serving its minimum and training a lease."""
    if cap.mode != "tidal":
        return []
    problems = []
    for m in models:
        lo, hi = m.capacity.min_replicas, m.capacity.max_replicas or m.replicas
        if not lo <= m.replicas <= hi:
            problems.append(
                f"model {m.name}: replicas={m.replicas} is outside models[].capacity [min_replicas={lo}, max_replicas="
                f"{hi}]: the fleet starts with `replicas`; set it between the two"
            )
    floor = sum(m.capacity.min_replicas for m in models) * cap.units_per_replica
    if floor > cap.usable_units:
        problems.append(
            f"the models' min_replicas need {floor} unit(s) but capacity has {cap.usable_units} usable "
            f"(total_units={cap.total_units} - reserved_units={cap.reserved_units}): lower min_replicas or "
            "capacity.units_per_replica, or raise capacity.total_units"
        )
    elif floor + cap.lease.min_units > cap.usable_units:
        problems.append(
            f"capacity.lease.min_units={cap.lease.min_units} never fits beside the models' min_replicas ({floor} "
            f"unit(s)) in {cap.usable_units} usable: training would never get a lease; lower lease.min_units or "
            "min_replicas, or raise capacity.total_units"
        )
    return problems
