"""Promote flow: deploy and verify the candidate, ramp a canary under an always-valid sequential test,
then promote it or roll it back, automatically.

    candidate  →  deploy (model's strategy) + served-weight probe  →  canary 5% → 25% → 50%
               →  promote (aliases, 100% route, old champion unloaded after a grace period)
               |  roll back (canary weight 0 at once, unloaded, failing check tagged)
               |  inconclusive (roll back, or a human decides through a Prefect pause)
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from tasks.promote import (
    abandon_release,
    admin_clients,
    deploy_and_verify,
    promote_candidate,
    reconcile_live,
    resolve_release,
    roll_back_candidate,
    run_canary,
    unload_after_grace,
)
from tasks.promote_approval import ask_human, needs_human
from tidal.flywheel_pause import ensure_running
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="promote", log_prints=True)
def promote(model: str = "tab", candidate: str = "@candidate", require_gate: bool = True) -> str:
    """Returns the outcome: 'promoted' or 'rolled_back'."""
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    cfg = settings.canary
    registry, store = Registry(settings.mlflow.tracking_uri), open_store(settings)
    ensure_running(store, model, "promote")  # a paused model releases nothing; a running canary rolls back
    fleet, routes = admin_clients(settings)
    gateway_url = f"http://{settings.gateway.host}:{settings.gateway.port}"

    live = reconcile_live(model, registry, routes, fleet)  # the routes are the truth; aliases and fleet follow them
    release = resolve_release(registry, model, candidate, require_gate, settings.model(model).update_strategy, live)
    deploy_and_verify(fleet, registry, release)
    # a gateway segment is open at most segment_max_age_s; a minute more covers clock skew between hosts
    span_s = settings.gateway.logsink.segment_max_age_s + 60
    try:
        look = run_canary(
            release,
            cfg,
            routes,
            fleet,
            registry,
            store,
            settings.collect.rule_for(model),
            gateway_url,
            log_segment_span_s=span_s,
            margins=settings.model(model).canary_margins,
            metrics=settings.model(model).canary,
            policy=settings.model(model).feedback,
        )
        if needs_human(look, cfg):  # the canary holds its weight until a human answers the typed form
            answer = ask_human(release, look, cfg, routes, registry, key=look.action)
            look.action = "promote" if answer.decision == "promote" else "rollback"
            look.reason = f"{answer.summary()} (canary: {look.reason})"
    except BaseException as e:  # a failed or interrupted release leaves no canary routed (or leaves it to the watchdog)
        abandon_release(release, e, routes, fleet, registry)
        raise
    if look.action == "promote":
        promote_candidate(release, look, routes, registry)
        reconcile_live(model, registry, routes, fleet)
        print(
            f"{model}: v{release.candidate.version} promoted ({look.reason}); "
            f"v{release.champion.version} stays loaded {cfg.unload_grace_s:.0f} s for instant rollback"
        )
        get_run_logger().info(unload_after_grace(fleet, release, cfg.unload_grace_s))
        return "promoted"
    roll_back_candidate(release, look, routes, fleet, registry)
    reconcile_live(model, registry, routes, fleet)
    print(f"{model}: v{release.candidate.version} rolled back: {look.reason}")
    return "rolled_back"
