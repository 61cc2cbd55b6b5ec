"""Prefect tasks of the promote flow (composed by flows/promote.py); the operations they use live in
release/operations.py.

Every transition is written to the candidate's MLflow version as a `tidal.release.*` tag (deployed,
verified, step N, promoted / rolled back / approved) and the ramp's step table becomes a Prefect
artifact, so the audit trail survives the flow run.
"""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from data_contracts.reward_rules import BaseRewardRule
from release.canary_config import CanaryConfig
from release.live_state import LiveState, reconcile
from release.operations import (
    Release,
    ReleaseError,
    arm_counters,
    audit,
    candidate_verified,
    check_in,
    counters_since,
    log_plan,
    now_ms,
    roll_back_canary,
    route_when_served,
    user_histories,
)
from release.outcomes import LogReader, read_outcomes
from release.policy import Look, Ramp
from release.report import canary_key, canary_record
from serving.client import FleetClient, RoutesClient, fleet_client, routes_client
from serving.fleet_replies import DeployReply
from serving.settings import ServingSettings
from tasks.promote_approval import ask_human
from tidal import lineage
from tidal.flywheel_pause import paused
from tidal.model_settings import CanaryMetrics, FeedbackPolicy, Margins
from tidal.registry import Registry
from tidal.store import ObjectStore, put_json


def admin_clients(settings: ServingSettings) -> tuple[FleetClient, RoutesClient]:
    """The release's connections, as configured: the fleet supervisor's admin API and the gateway's routes."""
    return fleet_client(settings), routes_client(settings)


@task(cache_policy=NO_CACHE)
def reconcile_live(model: str, registry: Registry, routes: RoutesClient, fleet: FleetClient) -> LiveState:
    """The champion alias and the fleet's serving version made to follow the route table (release/live_state.py)."""
    live = reconcile(model, registry, routes, fleet, by="promote")
    for fix in live.fixed:
        get_run_logger().warning("%s: reconciled %s", model, fix)
    return live


@task(cache_policy=NO_CACHE)
def resolve_release(
    registry: Registry, model: str, candidate: str, require_gate: bool, strategy: str, live: LiveState
) -> Release:
    if live.canary is not None:
        raise ReleaseError(
            f"{model}: a canary of v{live.canary} is routed already (another release is running, or an "
            f"operator set it); wait for it to end, or end it with `tidal rollback {model}`"
        )
    champion = registry.by_alias(model, "champion")
    if champion is None:
        raise ReleaseError(f"{model} has no champion: run `tidal bootstrap {model}` first")
    cand = registry.resolve(model, candidate)
    if cand.version == champion.version:
        raise ReleaseError(f"{model} v{cand.version} is already the champion; nothing to release")
    if require_gate and cand.gate_passed is not True:
        raise ReleaseError(
            f"{model} v{cand.version} has not passed the offline gate "
            f"({cand.tags.get('tidal.gate.reason', 'no gate result')}); train it with `tidal train`"
        )
    return Release(model, champion, cand, strategy)


@task(cache_policy=NO_CACHE)
def deploy_and_verify(fleet: FleetClient, registry: Registry, release: Release) -> DeployReply:
    """Load the candidate with the model's update strategy; the fleet runs the served-weight probe on every
    replica and refuses (unloading it again) on a mismatch, so no traffic reaches unverified weights."""
    cand = release.candidate
    audit(registry, cand, "deployed", strategy="fleet")
    try:
        out = fleet.deploy(release.model, cand.version)
    except Exception as e:
        audit(registry, cand, "rolled_back", by="promote", reason=f"deploy or served-weight verification failed: {e}")
        raise ReleaseError(f"{cand.served_name} could not be deployed and verified: {e}") from e
    audit(registry, cand, "verified", probes=len(out.probes))
    return out


@task(cache_policy=NO_CACHE)
def run_canary(
    release: Release,
    cfg: CanaryConfig,
    routes: RoutesClient,
    fleet: FleetClient,
    registry: Registry,
    store: ObjectStore,
    rule: BaseRewardRule,
    gateway_url: str,
    log_segment_span_s: float | None = None,
    margins: Margins | None = None,
    metrics: CanaryMetrics | None = None,
    policy: FeedbackPolicy | None = None,
) -> Look:
    """Walk the ramp until it promotes, rolls back or is inconclusive; one look every poll_s. log_segment_span_s:
    the longest a gateway log segment stays open, with slack (LogReader skips segments closed before the start).
    margins: the model's guardrail margins (default cfg.margins); metrics: its primary and guardrails (default the Tab
    set); policy: its feedback policy (the score range). The step table goes to the store (canary_key)."""
    log = get_run_logger()
    model, cand, champ = release.model, release.candidate, release.champion
    versions = {"control": champ.version, "canary": cand.version}
    start_ms, base = now_ms(), arm_counters(gateway_url, model)
    history = user_histories(store, model, champ.version, cfg, rule, start_ms, log_segment_span_s, policy)
    log_plan(cfg, history, log, metrics.primary if metrics else cfg.primary)
    ramp, logs = Ramp(cfg, time.monotonic(), margins, metrics), LogReader(store, model, start_ms, log_segment_span_s)
    route_when_served(routes, model, cand.version, ramp.weight, f"canary step 1 at {ramp.weight:.0%}", cfg.watchdog_s)
    audit(registry, cand, "step_1", weight=ramp.weight, users_with_history=len(history))
    try:
        while True:
            time.sleep(cfg.poll_s)
            gone = check_in(routes, model, cand.version, cfg.watchdog_s)
            if gone:
                return Look("rollback", gone, ramp.step, ramp.weight, figures={})
            if stop := paused(store, model):  # `tidal pause`: traffic back to control now
                return Look("rollback", f"flywheel paused: {stop.describe()}", ramp.step, ramp.weight, figures={})
            outcomes = read_outcomes(logs, versions, rule, cfg.feedback_wait_s, now_ms(), history, policy=policy)
            step = ramp.step
            result = ramp.observe(
                outcomes,
                counters_since(arm_counters(gateway_url, model), base),
                time.monotonic(),
                probe_ok=candidate_verified(fleet, model, cand, release.strategy),
                clock_ms=now_ms(),
            )
            log.info("step %d (%.0f%%): %s: %s", step + 1, ramp.cfg.steps[step] * 100, result.action, result.reason)
            if result.action == "advance":
                if ramp.weight in cfg.approve_before:  # hold this weight until a human approves the next
                    answer = ask_human(release, result, cfg, routes, registry, key=f"step-{ramp.step + 1}")
                    if answer.decision == "rollback":
                        return Look("rollback", answer.summary(), ramp.step, ramp.weight, figures={})
                    ramp.restart_step(time.monotonic(), now_ms())
                routes.canary(
                    model,
                    cand.version,
                    ramp.weight,
                    by="promote",
                    reason=f"canary step {ramp.step + 1}: {result.reason}",
                    watch_s=cfg.watchdog_s,
                )
                audit(registry, cand, f"step_{ramp.step + 1}", weight=ramp.weight, after=result.row())
            elif result.action != "wait":
                publish_step_table(release, ramp)
                return result
    finally:
        try:
            put_json(
                store,
                canary_key(model, cand.version),
                canary_record(model, champ.version, cand.version, ramp.looks).model_dump(mode="json"),
            )
        except Exception as e:  # noqa: BLE001  the decision stands; only its step table is missing from the store
            log.warning("could not store the canary's step table: %s: %s", type(e).__name__, str(e)[:200])


def publish_step_table(release: Release, ramp: Ramp) -> None:
    rows = [lk.row() for lk in ramp.looks if lk.action != "wait"] or [lk.row() for lk in ramp.looks[-1:]]
    create_table_artifact(
        key=f"{release.model.replace('_', '-')}-canary",
        table=rows,
        description=f"Canary of {release.candidate.served_name} against {release.champion.served_name}",
    )


@task(cache_policy=NO_CACHE)
def promote_candidate(release: Release, look: Look, routes: RoutesClient, registry: Registry) -> None:
    """Champion alias → candidate, previous → the old champion, all traffic to the candidate, in that order
    of safety: the route change is the one atomic step users see."""
    model, cand, champ = release.model, release.candidate, release.champion
    routes.set(model, [{"name": "control", "version": cand.version, "weight": 1.0}], by="promote", reason=look.reason)
    registry.set_alias(model, "previous", champ.version)
    registry.set_alias(model, "champion", cand.version)
    audit(registry, cand, "promoted", reason=look.reason, replaced=champ.version, figures=look.row())


@task(cache_policy=NO_CACHE)
def unload_after_grace(fleet: FleetClient, release: Release, grace_s: float) -> str:
    """Stop serving the old champion once the grace period (instant rollback window) is over."""
    time.sleep(grace_s)
    try:
        fleet.undeploy(release.model, release.champion.version)
        return f"unloaded {release.champion.served_name}"
    except Exception as e:  # noqa: BLE001  the base of a lora model cannot be unloaded: it keeps serving adapters
        return f"kept {release.champion.served_name}: {e}"


def abandon_release(release: Release, error: BaseException, routes: RoutesClient, fleet: FleetClient, registry: Registry) -> None:
    """The release failed (an MLflow, store, gateway or supervisor error, a bug): its canary goes back to control
    now, each step on its own so that one failure does not stop the next. A step that fails here is left to the
    gateway's watchdog, which rolls the canary back once the release misses its check-in (canary.watchdog_s)."""
    log = get_run_logger()
    model, cand = release.model, release.candidate
    reason = f"the release failed: {type(error).__name__}: {str(error)[:300]}"
    try:
        roll_back_canary(routes, model, by="promote", reason=reason, version=cand.version)
    except Exception as e:  # noqa: BLE001  the watchdog does it once the check-in deadline passes
        log.error(
            "could not roll back %s's canary (%s: %s); the gateway's watchdog will",
            cand.served_name,
            type(e).__name__,
            str(e)[:200],
        )
        return  # still routed: unloading it would be refused anyway
    for step in (
        lambda: audit(registry, cand, "rolled_back", by="promote", reason=reason),
        lambda: fleet.undeploy(model, cand.version),
    ):
        try:
            step()
        except Exception as e:  # noqa: BLE001  traffic is off it; the rest is bookkeeping, reported
            log.warning("after rolling back %s: %s: %s", cand.served_name, type(e).__name__, str(e)[:200])


@task(cache_policy=NO_CACHE)
def roll_back_candidate(release: Release, look: Look, routes: RoutesClient, fleet: FleetClient, registry: Registry) -> None:
    """Canary weight → 0 at once (one atomic route change), then unload it and record why."""
    model, cand = release.model, release.candidate
    roll_back_canary(routes, model, by="promote", reason=look.reason)
    audit(registry, cand, "rolled_back", by="promote", reason=look.reason, figures=look.row())
    registry.set_tags(model, cand.version, {lineage.RELEASE_FAILED_CHECK: look.reason})
    try:
        fleet.undeploy(model, cand.version)
    except Exception as e:  # noqa: BLE001  traffic is already off it; an unload failure is reported, not fatal
        get_run_logger().warning("could not unload %s: %s", cand.served_name, e)
