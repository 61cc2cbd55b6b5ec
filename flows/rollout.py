"""Rollout flow: the champion alias moved by hand in the registry (release/registry_webhook.py) becomes what users get.

champion alias → v  →  verified: probe on every replica (deploy with the model's strategy unless served)
                    |  immediate (the version's tidal.rollout_immediate tag): no wait for every replica
                 →  all traffic to v in one route change; `previous` → the version it replaced
                 |  failed: champion alias back to the served version, the failure tagged on v
"""

from __future__ import annotations

from prefect import flow

from tasks.promote import admin_clients
from tasks.rollout import roll_out
from tidal.registry import Registry
from tidal.settings import load_settings


@flow(name="rollout", log_prints=True)
def rollout(model: str = "tab", version: int = 0, immediate: bool = False, by: str = "registry") -> int:
    """Returns the version served to everyone."""
    settings = load_settings()
    strategy = settings.model(model).update_strategy  # unknown model → clear error
    registry = Registry(settings.mlflow.tracking_uri)
    fleet, routes = admin_clients(settings)
    out = roll_out(registry, routes, fleet, model, version, strategy, immediate, by)
    print(f"{model}: v{out['serving']} serves all traffic ({out['reason']})")
    return out["serving"]
