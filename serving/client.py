"""HTTP clients of the admin APIs: fleet supervisor and gateway routes (used by the CLI, flows, tests)."""

from __future__ import annotations

import time

import httpx

from serving.fleet_replies import DeployReply, FleetStatus, ReplicaStatus, ScaleReply, ServingReply, UndeployReply
from serving.routes import ModelRoutes, RouteTableReply
from serving.settings import ServingSettings
from tidal.tokens import admin_token

# Idempotent calls are re-sent after a transport error: the server may close an idle keep-alive connection just
# as the client re-uses it (the request then fails with a reset or a disconnect, though the server is healthy).
IDEMPOTENT = frozenset({"GET", "PUT"})
RETRY_DELAYS_S = (0.2, 1.0)


class AdminError(RuntimeError):
    def __init__(self, service: str, status: int, detail: str):
        super().__init__(f"{service} answered {status}: {detail}")
        self.status, self.detail = status, detail


class _AdminClient:
    service = ""

    def __init__(self, url: str, token: str, timeout_s: float, retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S):
        self.http = httpx.Client(base_url=url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self.retry_delays_s = retry_delays_s

    def _call(self, method: str, path: str, **kw) -> dict:
        delays = self.retry_delays_s if method in IDEMPOTENT else ()
        for delay in delays:
            try:
                r = self.http.request(method, path, **kw)
                break
            except httpx.TransportError as e:
                if isinstance(e, httpx.TimeoutException):  # a slow server is not a dropped connection
                    raise
                time.sleep(delay)
        else:
            r = self.http.request(method, path, **kw)
        if not r.is_success:
            try:
                body = r.json()
                detail = body.get("detail") or body.get("error", {}).get("message") or r.text
            except ValueError:
                detail = r.text
            raise AdminError(self.service, r.status_code, str(detail))
        return r.json()


FleetError = AdminError


class FleetClient(_AdminClient):
    service = "fleet supervisor"

    def __init__(self, url: str, token: str, timeout_s: float = 1800.0):
        # Long timeout: a scale-up or rolling restart returns only once replicas are verified.
        super().__init__(url, token, timeout_s)

    def status(self) -> FleetStatus:
        return FleetStatus.model_validate(self._call("GET", "/fleet"))

    def scale(self, model: str, replicas: int) -> ScaleReply:
        return ScaleReply.model_validate(self._call("POST", f"/fleet/{model}/scale", json={"replicas": replicas}))

    def deploy(self, model: str, version: str | int) -> DeployReply:
        return DeployReply.model_validate(self._call("POST", f"/fleet/{model}/deploy", json={"version": str(version)}))

    def undeploy(self, model: str, version: str | int, force: bool = False) -> UndeployReply:
        """Stop serving a version; refused (409) while the gateway's route table sends it traffic, unless force."""
        return UndeployReply.model_validate(
            self._call("POST", f"/fleet/{model}/undeploy", json={"version": str(version), "force": force})
        )

    def set_serving(self, model: str, version: int) -> ServingReply:
        """The version the gateway serves a model on while it has no routes for it (must be served already)."""
        return ServingReply.model_validate(self._call("PUT", f"/fleet/{model}/serving", json={"version": str(version)}))

    def replicas(self, model: str) -> list[ReplicaStatus]:
        return self.status().models[model].replicas


class RoutesClient(_AdminClient):
    service = "gateway"

    def __init__(self, url: str, token: str, timeout_s: float = 30.0, retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S):
        super().__init__(url, token, timeout_s, retry_delays_s)

    def show(self) -> RouteTableReply:
        return RouteTableReply.model_validate(self._call("GET", "/admin/routes"))

    def canary(
        self, model: str, version: int, weight: float, by: str = "cli", reason: str = "", watch_s: float | None = None
    ) -> ModelRoutes:
        """watch_s: the caller will check in (`watch`) within this many seconds, or the gateway rolls the canary back."""
        return ModelRoutes.model_validate(
            self._call(
                "POST",
                f"/admin/routes/{model}/canary",
                json={"version": version, "weight": weight, "by": by, "reason": reason, "watch_s": watch_s},
            )
        )

    def watch(self, model: str, version: int, watch_s: float) -> ModelRoutes:
        """Check in as the release watching the canary `version`; AdminError 409 once it is no longer routed."""
        return ModelRoutes.model_validate(
            self._call("POST", f"/admin/routes/{model}/canary/watch", json={"version": version, "watch_s": watch_s})
        )

    def set(self, model: str, arms: list[dict], by: str = "cli", reason: str = "") -> ModelRoutes:
        return ModelRoutes.model_validate(
            self._call("PUT", f"/admin/routes/{model}", json={"arms": arms, "by": by, "reason": reason})
        )

    def rollback(self, model: str, by: str = "cli", reason: str = "") -> ModelRoutes:
        return ModelRoutes.model_validate(
            self._call("POST", f"/admin/routes/{model}/rollback", json={"by": by, "reason": reason})
        )


def fleet_client(settings: ServingSettings, timeout_s: float = 1800.0) -> FleetClient:
    """The fleet supervisor's admin API as configured. timeout_s: a deploy or scale answers once its replicas are
    verified (minutes); status reads need less."""
    return FleetClient(f"http://{settings.fleet.host}:{settings.fleet.admin_port}", admin_token(settings), timeout_s)


def routes_client(settings: ServingSettings) -> RoutesClient:
    """The gateway's route admin API as configured."""
    return RoutesClient(f"http://{settings.gateway.host}:{settings.gateway.port}", admin_token(settings))
