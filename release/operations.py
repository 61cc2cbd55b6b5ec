"""The release plane's plain operations, shared by the promote flow's tasks, the CLI and the flow runner:
a release's identity and audit trail, the gateway's per-arm counters, the served-weight check, route changes
once the gateway lists a version, the watchdog's check-in, the users' pre-ramp history, and the instant
rollback. No Prefect here: tasks/promote.py wraps these as the flow's steps."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import httpx

from data_contracts.reward_rules import BaseRewardRule
from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth, History, histories
from release.live_state import reconcile
from release.outcomes import LogReader, read_outcomes
from serving.client import AdminError, FleetClient, RoutesClient
from serving.routes import ArmSpec
from tidal import lineage
from tidal.clock import now_ms
from tidal.model_settings import FeedbackPolicy
from tidal.registry import Registry, VersionInfo
from tidal.store import ObjectStore


class ReleaseError(RuntimeError):
    """The release cannot go on; the message says why and what to do."""


@dataclass
class Release:
    model: str
    champion: VersionInfo
    candidate: VersionInfo
    strategy: str  # the model's update strategy: how the candidate is served beside the champion


def audit(registry: Registry, info: VersionInfo, event: str, **details) -> None:
    """One transition as a version tag `tidal.release.<event>`: JSON with the time and the details."""
    registry.set_tags(info.model, info.version, {lineage.release_tag(event): json.dumps({"at_ms": now_ms(), **details})})


_SAMPLE = re.compile(r"^(gateway_completion(?:s|_errors)_total)\{(.*)\}\s+([0-9.eE+-]+)$")


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


def counters_since(now: dict[str, ArmHealth], base: dict[str, ArmHealth]) -> dict[str, ArmHealth]:
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
    ready = [r for r in fleet.replicas(model) if r.state == "ready"]
    serving = [r for r in ready if cand.served_name in r.served]
    return bool(serving) and (strategy != "lora" or len(serving) == len(ready))


def served_arms(routes: RoutesClient, fleet: FleetClient, model: str) -> dict[str, int]:
    """Arm name → version users get now: the route table's arms, or with no routes the fleet's serving version
    (what the gateway falls back to) as `control`; {} when the model serves nothing yet."""
    table = routes.show().get(model)
    if table is not None:
        return {a.name: a.version for a in table.arms}
    group = fleet.status().models.get(model)
    return {"control": group.serving_version} if group is not None else {}


def when_served(change, timeout_s: float = 60.0):
    """Run a route change once the gateway lists the versions it names: the gateway polls the fleet every
    gateway.fleet_poll_s, so right after a deploy (or while a replica is briefly out of rotation) it answers 409."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return change()
        except AdminError as e:
            if e.status != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def route_when_served(
    routes: RoutesClient, model: str, version: int, weight: float, reason: str, watch_s: float, timeout_s: float = 60.0
) -> None:
    """Set the canary weight once the gateway lists the verified version. From then on the release must check
    in within watch_s at every look, or the gateway rolls the canary back by itself."""
    when_served(lambda: routes.canary(model, version, weight, by="promote", reason=reason, watch_s=watch_s), timeout_s)


def check_in(routes: RoutesClient, model: str, version: int, watch_s: float) -> str:
    """Tell the gateway's watchdog this release still watches its canary (next check-in due within watch_s).
    Returns "" while the canary is routed, else why it is gone (an operator's `tidal rollback`, or the watchdog)."""
    try:
        routes.watch(model, version, watch_s)
        return ""
    except AdminError as e:
        if e.status != 409:
            raise
    last = routes.show().get(model)
    by, why = (last.updated_by, last.reason) if last else ("?", "")
    if by == "watchdog":
        return f"canary removed from the routes by the gateway's release watchdog ({why})"
    return f"canary removed from the routes by an operator ({by}: {why})"


def canary_arm(routes: RoutesClient, model: str) -> ArmSpec | None:
    """The canary arm routed for model, or None."""
    table = routes.show().get(model)
    return table.canary if table else None


def roll_back_canary(routes: RoutesClient, model: str, by: str, reason: str, version: int | None = None) -> bool:
    """Route all of model's traffic back to its control arm if a canary (of `version`, when given) is routed;
    True if one was. The one way every release path (a failed or orphaned run, a rollback decision) ends a canary."""
    arm = canary_arm(routes, model)
    if arm is None or (version is not None and arm.version != version):
        return False
    routes.rollback(model, by=by, reason=reason)
    return True


def user_histories(
    store: ObjectStore,
    model: str,
    champion: int,
    cfg: CanaryConfig,
    rule: BaseRewardRule,
    start_ms: int,
    log_segment_span_s: float | None,
    policy: FeedbackPolicy | None = None,
) -> dict[str, History]:
    """Each user's outcomes of the champion in the history_s before the canary started: CUPED's covariates."""
    if not cfg.cuped or cfg.history_s <= 0:
        return {}
    since = start_ms - int(cfg.history_s * 1000)
    before = read_outcomes(
        LogReader(store, model, since, log_segment_span_s),
        {"control": champion},
        rule,
        cfg.feedback_wait_s,
        start_ms,
        until_ms=start_ms,
        policy=policy,
    )
    return histories(before)


def log_plan(cfg: CanaryConfig, history: dict[str, History], log, primary: str | None = None) -> None:
    """The power calculation of every step for the model's `primary` (default cfg.primary), and the traffic it
    assumes, in the flow's log."""
    rate = sum(h.n for h in history.values()) / cfg.history_s if history else None
    plans = cfg.plan()  # each step's power search, once
    for w, p in zip(cfg.steps, plans):
        when = f" (~{p.detect_requests / rate:.0f} s at the last hour's {rate:.1f} requests/s)" if rate else ""
        log.info(
            "step at %.0f%%: a %.2f-sd regression of %s is rolled back within %d requests (80%% power)%s; an "
            "unchanged candidate clears it after ~%d (at advance_risk %g)",
            w * 100,
            cfg.detect_regression_sd,
            primary or cfg.primary,
            p.detect_requests,
            when,
            p.clear_requests,
            cfg.advance_risk,
        )
    first = plans[0].detect_requests
    if rate and first / rate > cfg.max_step_s:
        log.warning(
            "at %.1f requests/s the first step cannot decide a %.2f-sd regression within max_step_s=%.0f s: "
            "raise canary.max_step_s or canary.steps[0], or accept an inconclusive first step",
            rate,
            cfg.detect_regression_sd,
            cfg.max_step_s,
        )
    if cfg.max_step_outcomes is not None and first > cfg.max_step_outcomes:
        log.warning(
            "the first step needs ~%d outcomes to decide a %.2f-sd regression, more than max_step_outcomes=%d: raise "
            "canary.max_step_outcomes or canary.steps[0], or accept an inconclusive first step",
            first,
            cfg.detect_regression_sd,
            cfg.max_step_outcomes,
        )


def rollback_now(
    registry: Registry,
    routes: RoutesClient,
    fleet: FleetClient,
    model: str,
    to: str | None = None,
    by: str = "cli",
    reason: str = "",
) -> dict:
    """Instant rollback at any time: traffic to the target in one atomic route change, then the aliases.

    Target: `to`; else the control version while a canary runs; else the champion alias while the routes are ahead
    of it (a promotion between its route change and its alias moves); else the `previous` alias (the champion a
    promotion replaced). A target no replica serves any more is deployed (and verified) first.
    """
    t0 = time.monotonic()
    current = routes.show().get(model)
    arms = {a.name: a.version for a in current.arms} if current else {}
    aliases = registry.aliases(model)
    control = arms.get("control", aliases.get("champion"))
    if to is not None:
        target = registry.resolve(model, to).version
    elif "canary" in arms:
        target = control
    elif aliases.get("champion") not in (None, control):
        # a promotion's route change has landed and its alias moves have not (tasks/promote.py promote_candidate):
        # the champion alias still names the version it replaced, while `previous` is missing or an older one
        target = aliases["champion"]
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
    left = sorted({v for v in (arms.get("canary"), control) if v is not None and v != target})
    for version in left:
        audit(registry, registry.get(model, version), "manual_rollback", by=by, reason=why, to=target)
    champion = aliases.get("champion")
    if champion is not None and champion != target:
        registry.set_alias(model, "previous", champion)
        registry.set_alias(model, "champion", target)
    reconcile(model, registry, routes, fleet, by=by)  # the fleet's serving version follows too
    return {"model": model, "serving": target, "rolled_back": left, "route_change_s": round(seconds, 3), "by": by, "reason": why}
