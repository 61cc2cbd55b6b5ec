"""Releases driven from the MLflow registry: an operator who moves an alias in the MLflow UI starts the release
Tidal runs for that move.

    MLflow ──model_version_alias.created, HMAC-signed──▶ receiver (release/webhook_app.py)
        candidate → the promote-<model> deployment: verify, canary, promote or roll back (flows/promote.py)
        champion  → the rollout-<model> deployment: probe on every replica, then all traffic (flows/rollout.py)

Tidal's own alias moves (train's candidate, a promotion's or rollback's champion) carry a mark that the receiver
consumes (tidal/registry.py `set_alias`), so only a move made by someone else starts anything. Each delivery's
decision is stored under `state/registry-webhook/model=M/<delivery-id>.json`: MLflow retries a delivery with the
same id, and a retry gets the stored answer and starts nothing twice (the Prefect run is also created with the
delivery id as its idempotency key).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, Field

from release.operations import served_arms
from serving.client import FleetClient, RoutesClient
from tidal import lineage
from tidal.flywheel_pause import paused
from tidal.registry import Registry, RegistryError
from tidal.store import ObjectStore, get_json, put_json

SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER = "X-MLflow-Signature", "X-MLflow-Timestamp", "X-MLflow-Delivery-Id"
ALIAS_CREATED = "model_version_alias.created"
CLOCK_SKEW_S = 60.0  # a delivery stamped this far in the future is still accepted (the hosts' clocks differ)


class WebhookRefused(Exception):
    """A delivery the receiver does not accept: `status` is the HTTP answer (401 bad signature, 400 malformed)."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """MLflow's signature: `v1,` + base64 HMAC-SHA256 over `<delivery id>.<unix seconds>.<body>`."""
    digest = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, now_s: float, max_age_s: float) -> tuple[str, float]:
    """(delivery id, its unix time) of a delivery signed with `secret` and not older than max_age_s; else WebhookRefused."""
    delivery_id, stamp, signature = (headers.get(h, "") for h in (DELIVERY_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER))
    if not (delivery_id and stamp and signature):
        missing = [h for h in (DELIVERY_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER) if not headers.get(h)]
        raise WebhookRefused(401, f"not a signed MLflow delivery: missing {', '.join(missing)}")
    if not hmac.compare_digest(sign(secret, delivery_id, stamp, body).encode(), signature.encode()):
        raise WebhookRefused(401, "signature does not match: the webhook's secret differs from registry_webhook.secret")
    try:
        at_s = float(stamp)
    except ValueError:
        raise WebhookRefused(400, f"{TIMESTAMP_HEADER} is {stamp[:40]!r}; expected unix seconds") from None
    if not -CLOCK_SKEW_S <= now_s - at_s <= max_age_s:
        raise WebhookRefused(401, f"delivery stamped {now_s - at_s:.0f} s ago; accepted: up to {max_age_s:.0f} s (a replay?)")
    return delivery_id, at_s


class AliasEvent(BaseModel):
    """The `data` of a model_version_alias.created delivery."""

    name: str
    alias: str
    version: int


class Delivery(BaseModel):
    """A delivery's body (mlflow/webhooks/delivery.py): which event, when, and its payload."""

    entity: str
    action: str
    timestamp: str
    data: dict

    @property
    def event(self) -> str:
        return f"{self.entity}.{self.action}"


Action = Literal["ignored", "release", "rollout", "refused"]


class WebhookDecision(BaseModel):
    """What the receiver did with one delivery (stored; the reply to MLflow and to a redelivery)."""

    delivery_id: str
    event: str
    model: str = ""
    alias: str = ""
    version: int | None = None
    action: Action
    reason: str
    flow_run: str | None = Field(None, description="The Prefect run started (release or rollout).")
    gate_override: str | None = Field(None, description="The version's tidal.gate_override tag that let it through (who, why).")
    immediate: bool = Field(False, description="A champion rollout without the probe on every replica.")


def decision_key(model: str, delivery_id: str) -> str:
    safe = "".join(c for c in delivery_id if c.isalnum() or c in "-_")[:80] or "unnamed"
    return f"state/registry-webhook/model={model or '_'}/{safe}.json"


def stored_decision(store: ObjectStore, model: str, delivery_id: str) -> WebhookDecision | None:
    key = decision_key(model, delivery_id)
    return WebhookDecision.model_validate(get_json(store, key)) if store.exists(key) else None


def store_decision(store: ObjectStore, decision: WebhookDecision) -> None:
    put_json(store, decision_key(decision.model, decision.delivery_id), decision.model_dump(mode="json"))


def decide(
    delivery_id: str,
    delivery: Delivery,
    at_ms: int,
    models: list[str],
    registry: Registry,
    routes: RoutesClient,
    fleet: FleetClient,
    store: ObjectStore,
) -> WebhookDecision:
    """The receiver's decision for one verified delivery; it starts nothing (webhook_app.act does)."""
    if delivery.event != ALIAS_CREATED:
        return WebhookDecision(delivery_id=delivery_id, event=delivery.event, action="ignored", reason="not an alias move")
    ev = AliasEvent.model_validate(delivery.data)
    out = dict(delivery_id=delivery_id, event=delivery.event, model=ev.name, alias=ev.alias, version=ev.version)

    def answer(action: Action, reason: str, **kw) -> WebhookDecision:
        return WebhookDecision(**out, action=action, reason=reason, **kw)

    if ev.alias not in ("candidate", "champion"):
        return answer("ignored", f"alias {ev.alias!r}: Tidal acts on 'candidate' and 'champion'")
    if ev.name not in models:
        return answer("ignored", f"{ev.name} is not a model of this platform (models: {', '.join(models)})")
    try:
        info = registry.get(ev.name, ev.version)
    except RegistryError as e:  # no version to record the refusal on
        return WebhookDecision(**{**out, "version": None}, action="refused", reason=str(e))
    arms = served_arms(routes, fleet, ev.name)
    stop = paused(store, ev.name)
    if registry.own_alias_move(info, ev.alias, at_ms):  # last read: a failure before it leaves the mark for the retry
        return answer("ignored", f"Tidal's own move of {ev.alias!r}: nothing to start")
    if "canary" in arms:
        return answer(
            "refused",
            f"a canary of v{arms['canary']} is running; let it decide, or end it with `tidal rollback {ev.name}`, then set "
            f"{ev.alias!r} again",
        )
    override = info.tags.get(lineage.GATE_OVERRIDE) or None
    gate = info.gate_passed
    if ev.alias == "candidate":
        if arms.get("control") == ev.version:
            return answer("ignored", f"v{ev.version} is the champion serving all traffic already")
        if stop:
            return answer("refused", f"flywheel paused: {stop.describe()}; `tidal resume {ev.name}` first")
        if gate is not True and not override:
            return answer("refused", _gate_refusal(info, "candidate"))
        return answer("release", f"candidate set by hand: release v{ev.version}", gate_override=override)
    if arms.get("control") == ev.version:
        return answer("ignored", f"the routes serve v{ev.version} already")
    if gate is False and not override:  # never-gated versions (the bootstrap's, imports) may be champions again
        return answer("refused", _gate_refusal(info, "champion"))
    immediate = info.tags.get(lineage.IMMEDIATE) is not None
    how = "at once" if immediate else "after the probe on every replica"
    return answer("rollout", f"champion set by hand: serve v{ev.version} {how}", gate_override=override, immediate=immediate)


def _gate_refusal(info, alias: str) -> str:
    why = info.gate_reason or "no gate result"
    return (
        f"v{info.version} has not passed the offline gate ({why}); to make it {alias} anyway, set the version tag "
        f"{lineage.GATE_OVERRIDE} to who overrides and why, then set {alias!r} again"
    )
