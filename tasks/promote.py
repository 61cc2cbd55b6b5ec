"""Prefect tasks of the promote flow (composed by flows/promote.py), and the instant rollback.

Every transition is written to the candidate's MLflow version as a `tidal.release.*` tag (deployed,
verified, step N, promoted / rolled back / approved) and the ramp's step table becomes a Prefect
artifact, so the audit trail survives the flow run.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from data_contracts.outcomes import LogReader, read_outcomes
from data_contracts.rewards import RewardRule
from serving.canary_policy import ArmHealth, CanaryConfig, History, Look, Margins, Ramp, histories
from serving.canary_report import canary_key, canary_record
from serving.client import FleetClient, RoutesClient
from tasks.live_state import LiveState, reconcile
from tidal.registry import Registry, VersionInfo
from tidal.store import ObjectStore, put_json


class ReleaseError(RuntimeError):
    """The release cannot go on; the message says why and what to do."""


@dataclass
class Release:
    model: str
    champion: VersionInfo
    candidate: VersionInfo
    strategy: str  # the model's update strategy: how the candidate is served beside the champion


def now_ms() -> int:
    return int(time.time() * 1000)


def audit(registry: Registry, info: VersionInfo, event: str, **details) -> None:
    """One transition as a version tag `tidal.release.<event>`: JSON with the time and the details."""
    registry.set_tags(info.model, info.version, {f"tidal.release.{event}": json.dumps({"at_ms": now_ms(), **details})})


@task(cache_policy=NO_CACHE)
def reconcile_live(model: str, registry: Registry, routes: RoutesClient, fleet: FleetClient) -> LiveState:
    """The champion alias and the fleet's serving version made to follow the route table (tasks/live_state.py)."""
    live = reconcile(model, registry, routes, fleet, by="promote")
    for fix in live.fixed:
        get_run_logger().warning("%s: reconciled %s", model, fix)
    return live


@task(cache_policy=NO_CACHE)
def resolve_release(registry: Registry, model: str, candidate: str, require_gate: bool, strategy: str,
                    live: LiveState) -> Release:
    if live.canary is not None:
        raise ReleaseError(f"{model}: a canary of v{live.canary} is routed already (another release is running, or an "
                           f"operator set it); wait for it to end, or end it with `tidal rollback {model}`")
    champion = registry.by_alias(model, "champion")
    if champion is None:
        raise ReleaseError(f"{model} has no champion: run `tidal bootstrap {model}` first")
    cand = registry.resolve(model, candidate)
    if cand.version == champion.version:
        raise ReleaseError(f"{model} v{cand.version} is already the champion; nothing to release")
    if require_gate and cand.tags.get("tidal.gate.passed") != "true":
        raise ReleaseError(f"{model} v{cand.version} has not passed the offline gate "
                           f"({cand.tags.get('tidal.gate.reason', 'no gate result')}); train it with `tidal train`")
    return Release(model, champion, cand, strategy)


@task(cache_policy=NO_CACHE)
def deploy_and_verify(fleet: FleetClient, registry: Registry, release: Release) -> dict:
    """Load the candidate with the model's update strategy; the fleet runs the served-weight probe on every
    replica and refuses (unloading it again) on a mismatch, so no traffic reaches unverified weights."""
    cand = release.candidate
    audit(registry, cand, "deployed", strategy="fleet")
    try:
        out = fleet.deploy(release.model, cand.version)
    except Exception as e:
        audit(registry, cand, "rolled_back", by="promote", reason=f"deploy or served-weight verification failed: {e}")
        raise ReleaseError(f"{cand.served_name} could not be deployed and verified: {e}") from e
    audit(registry, cand, "verified", probes=len(out.get("probes", [])) if isinstance(out, dict) else None)
    return out


_SAMPLE = re.compile(r'^(gateway_completion(?:s|_errors)_total)\{(.*)\}\s+([0-9.eE+-]+)$')


def arm_counters(gateway_url: str, model: str) -> dict[str, ArmHealth]:
    """Requests and errors per arm since the gateway started, from its Prometheus metrics."""
    return parse_arm_counters(httpx.get(gateway_url + "/metrics", timeout=10).text, model)


def parse_arm_counters(text: str, model: str) -> dict[str, ArmHealth]:
    counts: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("model") != model:
            continue
        arm = counts.setdefault(labels.get("arm", ""), {"ok": 0.0, "err": 0.0})
        arm["ok" if m.group(1) == "gateway_completions_total" else "err"] += float(m.group(3))
    return {a: ArmHealth(requests=int(c["ok"] + c["err"]), errors=int(c["err"])) for a, c in counts.items()}


def _since(now: dict[str, ArmHealth], base: dict[str, ArmHealth]) -> dict[str, ArmHealth]:
    out = {}
    for arm, h in now.items():
        b = base.get(arm, ArmHealth())
        if h.requests < b.requests:  # the gateway restarted: its counters began again
            b = ArmHealth()
        out[arm] = ArmHealth(h.requests - b.requests, h.errors - b.errors)
    return out


def candidate_verified(fleet: FleetClient, model: str, cand: VersionInfo, strategy: str) -> bool:
    """The candidate is served by verified weights (a replica lists a version only after its probe passed):
    `lora` loads it on every ready replica; `restart` runs it on surge replicas beside the champion's, `reload`
    and `nccl` on replicas moved to it in place."""
    ready = [r for r in fleet.replicas(model) if r["state"] == "ready"]
    serving = [r for r in ready if cand.served_name in r["served"]]
    return bool(serving) and (strategy != "lora" or len(serving) == len(ready))


def when_served(change, timeout_s: float = 60.0):
    """Run a route change once the gateway lists the versions it names: the gateway polls the fleet every
    gateway.fleet_poll_s, so right after a deploy (or while a replica is briefly out of rotation) it answers 409."""
    from serving.client import AdminError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return change()
        except AdminError as e:
            if e.status != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def route_when_served(routes: RoutesClient, model: str, version: int, weight: float, reason: str, watch_s: float,
                      timeout_s: float = 60.0) -> None:
    """Set the canary weight once the gateway lists the verified version. From then on the release must check
    in within watch_s at every look, or the gateway rolls the canary back by itself."""
    when_served(lambda: routes.canary(model, version, weight, by="promote", reason=reason, watch_s=watch_s), timeout_s)


def check_in(routes: RoutesClient, model: str, version: int, watch_s: float) -> str:
    """Tell the gateway's watchdog this release still watches its canary (next check-in due within watch_s).
    Returns "" while the canary is routed, else why it is gone (an operator's `tidal rollback`, or the watchdog)."""
    from serving.client import AdminError

    try:
        routes.watch(model, version, watch_s)
        return ""
    except AdminError as e:
        if e.status != 409:
            raise
    last = routes.show()["routes"].get(model) or {}
    by, why = last.get("updated_by", "?"), last.get("reason", "")
    if by == "watchdog":
        return f"canary removed from the routes by the gateway's release watchdog ({why})"
    return f"canary removed from the routes by an operator ({by}: {why})"


def canary_arm(routes: RoutesClient, model: str) -> dict | None:
    """The canary arm routed for model, or None."""
    arms = routes.show()["routes"].get(model, {}).get("arms", [])
    return next((a for a in arms if a["name"] == "canary"), None)


def user_histories(store: ObjectStore, model: str, champion: int, cfg: CanaryConfig, rule: RewardRule, start_ms: int,
                   log_segment_span_s: float | None) -> dict[str, History]:
    """Each user's outcomes of the champion in the history_s before the canary started: CUPED's covariates."""
    if not cfg.cuped or cfg.history_s <= 0:
        return {}
    since = start_ms - int(cfg.history_s * 1000)
    before = read_outcomes(LogReader(store, model, since, log_segment_span_s), {"control": champion}, rule,
                           cfg.feedback_wait_s, start_ms, until_ms=start_ms)
    return histories(before)


def log_plan(cfg: CanaryConfig, history: dict[str, History], log) -> None:
    """The power calculation of every step, and the traffic it assumes, in the flow's log."""
    rate = sum(h.n for h in history.values()) / cfg.history_s if history else None
    for w, p in zip(cfg.steps, cfg.plan()):
        when = f" (~{p.detect_requests / rate:.0f} s at the last hour's {rate:.1f} requests/s)" if rate else ""
        log.info("step at %.0f%%: a %.2f-sd regression of %s is rolled back within %d requests (80%% power)%s; an "
                 "unchanged candidate clears it after ~%d", w * 100, cfg.detect_regression_sd, cfg.primary,
                 p.detect_requests, when, p.clear_requests)
    if rate and cfg.plan()[0].detect_requests / rate > cfg.max_step_s:
        log.warning("at %.1f requests/s the first step cannot decide a %.2f-sd regression within max_step_s=%.0f s: "
                    "raise canary.max_step_s or canary.steps[0], or accept an inconclusive first step",
                    rate, cfg.detect_regression_sd, cfg.max_step_s)


@task(cache_policy=NO_CACHE)
def run_canary(release: Release, cfg: CanaryConfig, routes: RoutesClient, fleet: FleetClient, registry: Registry,
               store: ObjectStore, rule: RewardRule, gateway_url: str, log_segment_span_s: float | None = None,
               margins: Margins | None = None) -> Look:
    """Walk the ramp until it promotes, rolls back or is inconclusive; one look every poll_s. log_segment_span_s:
    the longest a gateway log segment stays open, with slack (LogReader skips segments closed before the start).
    margins: the model's guardrail margins (default cfg.margins). The step table goes to the store (canary_key)."""
    log = get_run_logger()
    model, cand, champ = release.model, release.candidate, release.champion
    versions = {"control": champ.version, "canary": cand.version}
    start_ms, base = now_ms(), arm_counters(gateway_url, model)
    history = user_histories(store, model, champ.version, cfg, rule, start_ms, log_segment_span_s)
    log_plan(cfg, history, log)
    ramp, logs = Ramp(cfg, time.monotonic(), margins), LogReader(store, model, start_ms, log_segment_span_s)
    route_when_served(routes, model, cand.version, ramp.weight, f"canary step 1 at {ramp.weight:.0%}", cfg.watchdog_s)
    audit(registry, cand, "step_1", weight=ramp.weight, users_with_history=len(history))
    try:
        while True:
            time.sleep(cfg.poll_s)
            gone = check_in(routes, model, cand.version, cfg.watchdog_s)
            if gone:
                return Look("rollback", gone, ramp.step, ramp.weight, figures={})
            outcomes = read_outcomes(logs, versions, rule, cfg.feedback_wait_s, now_ms(), history)
            step = ramp.step
            result = ramp.observe(outcomes, _since(arm_counters(gateway_url, model), base), time.monotonic(),
                                  probe_ok=candidate_verified(fleet, model, cand, release.strategy), clock_ms=now_ms())
            log.info("step %d (%.0f%%): %s: %s", step + 1, ramp.cfg.steps[step] * 100, result.action, result.reason)
            if result.action == "advance":
                routes.canary(model, cand.version, ramp.weight, by="promote",
                              reason=f"canary step {ramp.step + 1}: {result.reason}", watch_s=cfg.watchdog_s)
                audit(registry, cand, f"step_{ramp.step + 1}", weight=ramp.weight, after=result.row())
            elif result.action != "wait":
                publish_step_table(release, ramp)
                return result
    finally:
        try:
            put_json(store, canary_key(model, cand.version),
                     canary_record(model, champ.version, cand.version, ramp.looks).model_dump(mode="json"))
        except Exception as e:  # noqa: BLE001  the decision stands; only its step table is missing from the store
            log.warning("could not store the canary's step table: %s: %s", type(e).__name__, str(e)[:200])


def publish_step_table(release: Release, ramp: Ramp) -> None:
    rows = [lk.row() for lk in ramp.looks if lk.action != "wait"] or [lk.row() for lk in ramp.looks[-1:]]
    create_table_artifact(key=f"{release.model.replace('_', '-')}-canary", table=rows,
                          description=f"Canary of {release.candidate.served_name} against {release.champion.served_name}")


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


def abandon_release(release: Release, error: BaseException, routes: RoutesClient, fleet: FleetClient,
                    registry: Registry) -> None:
    """The release failed (an MLflow, store, gateway or supervisor error, a bug): its canary goes back to control
    now, each step on its own so that one failure does not stop the next. A step that fails here is left to the
    gateway's watchdog, which rolls the canary back once the release misses its check-in (canary.watchdog_s)."""
    log = get_run_logger()
    model, cand = release.model, release.candidate
    reason = f"the release failed: {type(error).__name__}: {str(error)[:300]}"
    try:
        arm = canary_arm(routes, model)
        if arm is not None and arm["version"] == cand.version:
            routes.rollback(model, by="promote", reason=reason)
    except Exception as e:  # noqa: BLE001  the watchdog does it once the check-in deadline passes
        log.error("could not roll back %s's canary (%s: %s); the gateway's watchdog will", cand.served_name,
                  type(e).__name__, str(e)[:200])
        return  # still routed: unloading it would be refused anyway
    for step in (lambda: audit(registry, cand, "rolled_back", by="promote", reason=reason),
                 lambda: fleet.undeploy(model, cand.version)):
        try:
            step()
        except Exception as e:  # noqa: BLE001  traffic is off it; the rest is bookkeeping, reported
            log.warning("after rolling back %s: %s: %s", cand.served_name, type(e).__name__, str(e)[:200])


@task(cache_policy=NO_CACHE)
def roll_back_candidate(release: Release, look: Look, routes: RoutesClient, fleet: FleetClient, registry: Registry) -> None:
    """Canary weight → 0 at once (one atomic route change), then unload it and record why."""
    model, cand = release.model, release.candidate
    if canary_arm(routes, model) is not None:
        routes.rollback(model, by="promote", reason=look.reason)
    audit(registry, cand, "rolled_back", by="promote", reason=look.reason, figures=look.row())
    registry.set_tags(model, cand.version, {"tidal.release.failed_check": look.reason})
    try:
        fleet.undeploy(model, cand.version)
    except Exception as e:  # noqa: BLE001  traffic is already off it; an unload failure is reported, not fatal
        get_run_logger().warning("could not unload %s: %s", cand.served_name, e)


def rollback_now(registry: Registry, routes: RoutesClient, fleet: FleetClient, model: str, to: str | None = None,
                 by: str = "cli", reason: str = "") -> dict:
    """Instant rollback at any time: traffic to the target in one atomic route change, then the aliases.

    Target: `to`; else the control version while a canary runs; else the `previous` alias (the champion
    a promotion replaced). A target no replica serves any more is deployed (and verified) first.
    """
    from serving.client import AdminError

    t0 = time.monotonic()
    current = routes.show()["routes"].get(model) or {}
    arms = {a["name"]: a for a in current.get("arms", [])}
    aliases = registry.aliases(model)
    control = arms["control"]["version"] if "control" in arms else aliases.get("champion")
    if to is not None:
        target = registry.resolve(model, to).version
    elif "canary" in arms:
        target = control
    elif "previous" in aliases:
        target = aliases["previous"]
    else:
        raise ReleaseError(f"{model}: nothing to roll back to (no canary running, no 'previous' version); pass --to VERSION")
    why = reason or "manual rollback"
    if "canary" in arms and target == control:
        routes.rollback(model, by=by, reason=why)
    else:
        arm = [{"name": "control", "version": target, "weight": 1.0}]
        try:
            routes.set(model, arm, by=by, reason=why)
        except AdminError as e:
            if e.status != 409:
                raise
            fleet.deploy(model, target)  # not loaded any more: load and verify it (nothing to do if it is), then switch
            when_served(lambda: routes.set(model, arm, by=by, reason=why))
    seconds = time.monotonic() - t0
    left = sorted({v for v in (arms.get("canary", {}).get("version"), control) if v is not None and v != target})
    for version in left:
        audit(registry, registry.get(model, version), "manual_rollback", by=by, reason=why, to=target)
    champion = aliases.get("champion")
    if champion is not None and champion != target:
        registry.set_alias(model, "previous", champion)
        registry.set_alias(model, "champion", target)
    reconcile(model, registry, routes, fleet, by=by)  # the fleet's serving version follows too
    return {"model": model, "serving": target, "rolled_back": left, "route_change_s": round(seconds, 3), "by": by, "reason": why}
