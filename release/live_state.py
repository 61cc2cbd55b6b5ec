"""What is live, from one source of truth: the gateway's route table.

Three records say which version a model's users get:
  routes           the gateway's route table: what it actually does, changed in one atomic step;
  champion alias   the registry's record, what MLflow and people read (`previous` keeps the one before);
  fleet serving    the supervisor's serving version, the gateway's default for a model it has no routes for.
They are written one after another, so a crash between two writes left them disagreeing, and a resubmitted
release could then build a canary whose two arms were the same version.

The route table is authoritative. `reconcile` makes the other two follow its control arm. Where the gateway
has no routes for a model (a new gateway, or one whose state was lost), the champion alias is the durable
record, and the routes are written from it. It runs at the start of every release, after its last step,
after a manual rollback, and when the flow runner starts.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from serving.client import AdminError, FleetClient, RoutesClient
from tidal import lineage
from tidal.clock import now_ms
from tidal.registry import Registry


class LiveStateError(RuntimeError):
    """The records cannot be made to agree without an operator; the message says what to do."""


class LiveState(BaseModel):
    """A model's live versions once reconciled, and what had to be fixed to get there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Registered model name.")
    serving: int | None = Field(description="The control arm's version: what users get (None: nothing serves it yet).")
    canary: int | None = Field(None, description="The canary arm's version while one is routed.")
    fixed: list[str] = Field(default_factory=list, description="Each record that disagreed and how it was set.")


def reconcile(model: str, registry: Registry, routes: RoutesClient, fleet: FleetClient, by: str) -> LiveState:
    """Make the champion alias and the fleet's serving version follow the route table (see the module's doc)."""
    table = routes.show().get(model)
    champion = registry.by_alias(model, "champion")
    group = fleet.status().models.get(model)
    fleet_serving = group.serving_version if group else None
    fixed: list[str] = []
    if table is None:
        if champion is None:  # not bootstrapped: nothing is live yet
            return LiveState(model=model, serving=fleet_serving)
        serving = champion.version
        if fleet_serving != serving:  # the gateway would fall back to the fleet's version: route the champion
            try:
                routes.set(
                    model,
                    [{"name": "control", "version": serving, "weight": 1.0}],
                    by=by,
                    reason="reconcile: the gateway had no routes; the champion alias is the record",
                )
            except AdminError as e:
                if e.status != 409:
                    raise
                raise LiveStateError(
                    f"{model}: the gateway has no routes and the champion v{serving} is not served "
                    f"({e.detail}); deploy it (`tidal fleet deploy {model} {serving}`)"
                ) from e
            fixed.append(f"routes: none → control v{serving} (the champion alias)")
        canary = None
    else:
        serving, canary = table.control.version, table.canary.version if table.canary else None
        if champion is None or champion.version != serving:
            if champion is not None:
                registry.set_alias(model, "previous", champion.version)
            registry.set_alias(model, "champion", serving)
            registry.set_tags(
                model,
                serving,
                {
                    lineage.release_tag("reconciled"): json.dumps(
                        {"at_ms": now_ms(), "by": by, "champion_was": champion and champion.version}
                    )
                },
            )
            fixed.append(f"champion alias: v{champion and champion.version} → v{serving} (the routes' control arm)")
    if fleet_serving != serving:
        fleet.set_serving(model, serving)
        fixed.append(f"fleet serving version: v{fleet_serving} → v{serving}")
    return LiveState(model=model, serving=serving, canary=canary, fixed=fixed)
