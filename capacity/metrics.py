"""The capacity scheduler's /metrics (job tidal-capacity): units by holder, replicas and forecast by model, lease
events by kind. Built from the status at each scrape: every figure is the one `tidal status` shows."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from capacity.api import CapacityStatus

EVENT_KINDS = ("grant", "revoke", "release", "reclaim", "scale")


def render_metrics(status: CapacityStatus, counts: Mapping[str, int]) -> bytes:
    r = CollectorRegistry()
    units = Gauge("capacity_units", "Units of the pool by who holds them", ["holder"], registry=r)
    units.labels("serving").set(status.serving_units)
    units.labels("training").set(status.lent_units)
    units.labels("free").set(max(0, status.usable_units - status.serving_units - status.lent_units))
    Gauge("capacity_usable_units", "Units serving and training share", registry=r).set(status.usable_units)
    replicas = Gauge("capacity_replicas", "Replicas the fleet runs", ["model"], registry=r)
    needed = Gauge("capacity_needed_replicas", "Replicas the latest decision says demand needs", ["model"], registry=r)
    forecast = Gauge("capacity_forecast_rps", "Requests/s serving is sized for", ["model"], registry=r)
    for name, m in status.models.items():
        replicas.labels(name).set(m.replicas)
        needed.labels(name).set(m.needed)
        forecast.labels(name).set(m.forecast_rps)
    events = Counter("capacity_events", "Lease grants, revocations, releases, reclaims and scale decisions", ["kind"], registry=r)
    for kind in EVENT_KINDS:
        events.labels(kind).inc(counts.get(kind, 0))
    leases = Gauge("capacity_leases", "Leases holding units", ["state"], registry=r)
    for state in ("active", "revoking"):
        leases.labels(state).set(sum(1 for x in status.leases if x.state == state))
    return generate_latest(r)
