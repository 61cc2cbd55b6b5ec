"""Fleet supervisor process: owns the replicas, exposes an admin API (`python -m serving.supervisor`).

Operations block until done (a scale-up waits for verified replicas); GET /fleet stays responsive.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from serving import fleet_metrics
from serving.engine import EngineEnvironmentMissing, EngineError
from serving.fleet import Fleet
from serving.fleet_replies import DeployReply, FleetStatus, ScaleReply, ServingReply, UndeployReply
from serving.probe import ProbeFailed
from serving.route_guard import RoutedVersion, RouteGuard, RoutesUnknown
from serving.runtime.base import ClusterError
from serving.settings import ServingSettings, load_serving_settings
from serving.weight_sync import StrategyUnavailable
from tidal.client_env import mlflow_env
from tidal.procs import NotReady, PortInUse
from tidal.registry import CheckpointCache, CheckpointCorrupt, Registry, RegistryError
from tidal.section import SettingsError
from tidal.store import open_store
from tidal.tokens import admin_authorized, admin_token

log = logging.getLogger("tidal.supervisor")

# exception type → HTTP status; the message is the detail.
ERRORS: dict[type[Exception], int] = {
    RegistryError: 404,
    SettingsError: 400,
    StrategyUnavailable: 400,
    ValueError: 400,
    ProbeFailed: 409,
    NotReady: 503,
    PortInUse: 503,
    EngineError: 502,
    FileNotFoundError: 404,
    EngineEnvironmentMissing: 500,
    CheckpointCorrupt: 409,
    ClusterError: 502,
    RoutedVersion: 409,
    RoutesUnknown: 503,
}


class ScaleRequest(BaseModel):
    replicas: int = Field(..., ge=0, le=64, description="Replicas to keep running.")


class VersionRequest(BaseModel):
    version: str = Field(..., min_length=1, max_length=64, description="'3', 'v3' or an alias like '@candidate'.")


class UndeployRequest(VersionRequest):
    force: bool = Field(False, description="Unload even if the gateway's route table sends it traffic or cannot be read.")


class FleetState:
    """The fleet plus how its start-up went (it starts in the background so the API answers at once), and the
    guard that keeps a version the route table sends traffic to from being unloaded (None: no gateway to ask)."""

    def __init__(self, fleet: Fleet, guard: RouteGuard | None = None):
        self.fleet, self.guard, self.ready, self.error = fleet, guard, False, ""

    def start(self) -> None:
        try:
            self.fleet.start()
            self.ready = True
        except Exception as e:  # reported through GET /fleet, and the log
            log.exception("fleet start failed")
            self.error = f"{type(e).__name__}: {e}"


def build_app(state: FleetState, token: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.start, name="fleet-start", daemon=True).start()
        yield
        state.fleet.stop()

    app = FastAPI(title="Tidal fleet supervisor", lifespan=lifespan)

    def admin(authorization: str = Header("")) -> None:
        if not admin_authorized(authorization, token):
            raise HTTPException(401, "missing or wrong admin token (Authorization: Bearer <token>)")

    async def known_error(request: Request, exc: Exception):
        code = next(ERRORS[cls] for cls in type(exc).__mro__ if cls in ERRORS)  # most specific type wins
        return JSONResponse({"detail": str(exc)}, status_code=code)

    # One handler per known type: a catch-all Exception handler runs in Starlette's outermost
    # middleware, which re-raises after answering and resets the connection.
    for kind in ERRORS:
        app.add_exception_handler(kind, known_error)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    def metrics() -> Response:  # counts and states only, like the gateway's: no token, no names of secrets
        return Response(fleet_metrics.render(state.fleet.status(), state.ready), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet", dependencies=[Depends(admin)])
    def fleet_status() -> FleetStatus:
        waiting = "; ".join(state.fleet.waiting.values())  # models with no version to serve yet
        return FleetStatus(ready=state.ready and not waiting, error=state.error or waiting or None, **dict(state.fleet.status()))

    @app.post("/fleet/{model}/scale", dependencies=[Depends(admin)])
    def scale(model: str, body: ScaleRequest) -> ScaleReply:
        replicas = state.fleet.scale(model, body.replicas)
        return ScaleReply(model=model, replicas=[r.status() for r in replicas])

    @app.post("/fleet/{model}/deploy", dependencies=[Depends(admin)])
    def deploy(model: str, body: VersionRequest) -> DeployReply:
        reports = state.fleet.deploy(model, body.version)
        return DeployReply(model=model, version=body.version, probes=[r.summary() for r in reports])

    @app.put("/fleet/{model}/serving", dependencies=[Depends(admin)])
    def set_serving(model: str, body: VersionRequest) -> ServingReply:
        return ServingReply(model=model, serving_version=state.fleet.set_serving(model, body.version))

    @app.post("/fleet/{model}/undeploy", dependencies=[Depends(admin)])
    def undeploy(model: str, body: UndeployRequest) -> UndeployReply:
        group = state.fleet.group(model)
        info = state.fleet.registry.resolve(model, body.version)
        # The version the replicas run is refused by the fleet itself, with its own reason, unless a surge version
        # can replace it (`restart`, `reload`, `nccl`): that rolling replacement is an unload too.
        if state.guard is not None and not body.force and (info.version != group.base.version or group.surge):
            state.guard.check_unload(model, info.version, info.served_name, group.serving)
        state.fleet.undeploy(model, body.version)
        return UndeployReply(model=model, version=body.version, undeployed=True)

    return app


def serve(settings: ServingSettings) -> None:
    os.environ.update(mlflow_env(settings))  # a remote MLflow's credential and CA, read from the settings at start-up
    store = open_store(settings)
    fleet = Fleet(settings, Registry(settings.mlflow.tracking_uri), CheckpointCache(store, settings.data_path / "cache"))
    guard = RouteGuard(
        f"http://{settings.gateway.host}:{settings.gateway.port}",
        admin_token(settings),
        settings.data_path / "gateway" / "routes.json",
    )
    app = build_app(FleetState(fleet, guard), admin_token(settings))
    uvicorn.run(app, host=settings.fleet.host, port=settings.fleet.admin_port, log_level="warning")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    serve(load_serving_settings())


if __name__ == "__main__":
    main()
