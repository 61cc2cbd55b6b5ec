"""The registry webhook's receiver (release/registry_webhook.py): `python -m release.webhook_app`.

At start it registers itself with MLflow (one webhook named `tidal-releases` per receiver URL, its secret set each
time), then answers each signed delivery with its decision: 200 for every decision (a refusal is recorded, not
retried), 401 for a bad signature or a replay, 400 for a malformed body. Deliveries are handled one at a time.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from release.operations import audit, served_arms
from release.registry_webhook import (
    ALIAS_CREATED,
    Delivery,
    WebhookDecision,
    WebhookRefused,
    decide,
    store_decision,
    stored_decision,
    verify,
)
from release.webhook_settings import RegistryWebhookSettings
from serving.client import fleet_client, routes_client
from serving.settings import ServingSettings
from tidal.client_env import mlflow_env, prefect_env
from tidal.core_settings import load_root
from tidal.registry import Registry
from tidal.store import open_store
from tidal.tokens import secret

log = logging.getLogger("tidal.registry_webhook")
WEBHOOK_NAME = "tidal-releases"


class ReceiverSettings(ServingSettings):
    """What the receiver reads: serving's sections (the models, the gateway's routes) and its own; the training
    plane's sections are not its business (and would load torch)."""

    registry_webhook: RegistryWebhookSettings = Field(default_factory=RegistryWebhookSettings)


def webhook_secret(settings: ReceiverSettings) -> str:
    return secret(settings.data_path, "registry_webhook", settings.registry_webhook.secret)


def register_webhook(registry: Registry, url: str, signing_secret: str) -> str:
    """The MLflow webhook that calls `url` on alias moves, created or brought up to date; returns its id."""
    client = registry.client
    found, token = None, None
    while found is None:
        page = client.list_webhooks(max_results=100, page_token=token)
        found = next((w for w in page if w.name == WEBHOOK_NAME and w.url == url), None)
        if not (token := page.token):
            break
    if found is None:
        return client.create_webhook(
            WEBHOOK_NAME, url, [ALIAS_CREATED], "Tidal: releases from alias moves", signing_secret
        ).webhook_id
    client.update_webhook(found.webhook_id, events=[ALIAS_CREATED], secret=signing_secret, status="ACTIVE")
    return found.webhook_id


def act(decision: WebhookDecision, registry: Registry, routes, fleet) -> WebhookDecision:
    """Start what the decision says (a Prefect run of the model's promote or rollout deployment) and record it on the
    version; a refused champion alias goes back to the version the routes serve, so aliases and routes agree."""
    from prefect.deployments import run_deployment

    model, version = decision.model, decision.version
    details = dict(delivery=decision.delivery_id, alias=decision.alias, reason=decision.reason)
    if decision.gate_override:
        audit(registry, registry.get(model, version), "gate_override", by=decision.gate_override, **details)
    if decision.action in ("release", "rollout"):  # the model's promote or rollout deployment, once per delivery
        flow, parameters = (
            ("promote", {"model": model, "candidate": str(version), "require_gate": decision.gate_override is None})
            if decision.action == "release"
            else ("rollout", {"model": model, "version": version, "immediate": decision.immediate})
        )
        run = run_deployment(
            name=f"{flow}/{flow}-{model}",
            parameters=parameters,
            idempotency_key=f"mlflow-webhook-{decision.delivery_id}",
            timeout=0,
        )
        decision.flow_run = str(run.id)
    elif decision.action == "refused" and version is not None:
        audit(registry, registry.get(model, version), "registry_refused", **details)
        served = served_arms(routes, fleet, model).get("control")
        if decision.alias == "champion" and served is not None and served != version:
            registry.set_alias(model, "champion", served)
    if decision.flow_run:
        audit(registry, registry.get(model, version), f"registry_{decision.action}", flow_run=decision.flow_run, **details)
    return decision


def create_app(settings: ReceiverSettings) -> FastAPI:
    cfg, signing_secret = settings.registry_webhook, webhook_secret(settings)
    registry, store = Registry(settings.mlflow.tracking_uri), open_store(settings)
    routes, fleet = routes_client(settings), fleet_client(settings, timeout_s=30.0)
    models, one_at_a_time = [m.name for m in settings.models], threading.Lock()
    app = FastAPI(title="Tidal registry webhook")

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/mlflow-webhook")
    async def receive(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            delivery_id, at_s = verify(signing_secret, request.headers, body, time.time(), cfg.max_age_s)
            delivery = Delivery.model_validate_json(body)
        except WebhookRefused as e:
            log.warning("refused a delivery: %s", e.detail)
            return JSONResponse({"error": e.detail}, status_code=e.status)
        except ValidationError as e:
            return JSONResponse({"error": f"not an MLflow webhook body: {e.errors()[0]['msg']}"}, status_code=400)
        return await run_in_threadpool(handle, delivery_id, delivery, int(at_s * 1000))

    def handle(delivery_id: str, delivery: Delivery, at_ms: int) -> JSONResponse:
        with one_at_a_time:
            model = str(delivery.data.get("name", ""))
            if (done := stored_decision(store, model, delivery_id)) is not None:  # MLflow's retry of a delivery
                return JSONResponse(done.model_dump(mode="json"))
            try:
                decision = decide(delivery_id, delivery, at_ms, models, registry, routes, fleet, store)
                decision = act(decision, registry, routes, fleet) if decision.action != "ignored" else decision
                store_decision(store, decision)  # a retry of this delivery gets this answer
            except ValidationError as e:
                return JSONResponse({"error": f"not an alias event: {e.errors()[0]['msg']}"}, status_code=400)
            except Exception as e:  # noqa: BLE001  MLflow retries a 5xx: a transient registry or Prefect error heals
                log.exception("delivery %s failed", delivery_id)
                return JSONResponse({"error": f"{type(e).__name__}: {str(e)[:300]}"}, status_code=503)
            log.info("%s %s v%s → %s: %s", decision.model, decision.alias, decision.version, decision.action, decision.reason)
            return JSONResponse(decision.model_dump(mode="json"))

    return app


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_root(ReceiverSettings)
    os.environ.update({**prefect_env(settings), **mlflow_env(settings)})  # run_deployment and the registry's clients
    cfg = settings.registry_webhook
    app = create_app(settings)
    webhook = register_webhook(Registry(settings.mlflow.tracking_uri), cfg.endpoint, webhook_secret(settings))
    log.info("registered MLflow webhook %s → %s", webhook, cfg.endpoint)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")


if __name__ == "__main__":
    main()
