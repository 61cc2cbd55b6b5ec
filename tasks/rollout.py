"""The task of the rollout flow (flows/rollout.py): serve a version the champion alias was moved to by hand."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from release.live_state import reconcile
from release.operations import audit, candidate_verified, served_arms, when_served
from serving.client import FleetClient, RoutesClient
from tidal.registry import Registry


@task(cache_policy=NO_CACHE)
def roll_out(
    registry: Registry,
    routes: RoutesClient,
    fleet: FleetClient,
    model: str,
    version: int,
    strategy: str,
    immediate: bool,
    by: str,
) -> dict:
    """All traffic to `version` in one route change. Verified (the default): unless every ready replica already lists
    it (a replica lists a version only after its probe passed), it is deployed first with the model's strategy, whose
    probe runs on every replica. Immediate: routed at once wherever it is served (deployed only if nowhere).
    The version served before becomes `previous`; on any failure the champion alias goes back to it."""
    info = registry.get(model, version)
    served = served_arms(routes, fleet, model).get("control")
    reason = f"champion alias moved to v{version} in the registry ({'immediate' if immediate else 'verified'} rollout)"
    try:
        ready = [r for r in fleet.replicas(model) if r.state == "ready"]
        anywhere = any(info.served_name in r.served for r in ready)
        if not (candidate_verified(fleet, model, info, strategy) or (immediate and anywhere)):
            audit(registry, info, "deployed", strategy="fleet", by=by)
            probes = fleet.deploy(model, version).probes  # refused, and unloaded again, on a probe mismatch
            audit(registry, info, "verified", probes=len(probes), by=by)
        t0 = time.monotonic()
        # the gateway learns what the fleet serves at its next poll: until then it answers 409
        when_served(lambda: routes.set(model, [{"name": "control", "version": version, "weight": 1.0}], by=by, reason=reason))
        seconds = time.monotonic() - t0
    except Exception as e:
        audit(registry, info, "rollout_failed", by=by, reason=f"{type(e).__name__}: {str(e)[:300]}")
        if served is not None and served != version:
            registry.set_alias(model, "champion", served)  # aliases follow what is served
        raise
    if served is not None and served != version:
        registry.set_alias(model, "previous", served)
    registry.set_alias(model, "champion", version)
    reconcile(model, registry, routes, fleet, by=by)  # the fleet's serving version follows the routes too
    audit(registry, info, "rolled_out", by=by, immediate=immediate, replaced=served)
    return {"model": model, "serving": version, "replaced": served, "route_change_s": round(seconds, 3), "reason": reason}
