"""Gateway HTTP API (thin handlers over serving.gateway.Gateway); `python -m serving.gateway_app`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from contextlib import asynccontextmanager

import orjson
import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from serving.api_models import (
    CanaryUpdate,
    CanaryWatch,
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    FeedbackResponse,
    RollbackRequest,
    RoutesUpdate,
)
from serving.data_plane import (
    BodyTooLarge,
    CompletionPlane,
    declared_ok,
    detail_body,
    error_body,
    invalid_values,
    too_large_body,
)
from serving.gateway import Gateway, GatewayError, Limits
from serving.gateway_metrics import GatewayMetrics, RateLimiter
from serving.http_protocol import GatewayHttpProtocol
from serving.logsink import LogSink
from serving.request_ids import RequestIdSigner
from serving.routes import CanaryGone, ModelRoutes, RouteError, RouteTable, RouteTableReply
from serving.settings import ServingSettings, client_keys, load_serving_settings
from serving.upstream import ReplicaPool
from tidal.clock import now_ms
from tidal.store import open_store
from tidal.tokens import admin_authorized, admin_token, bearer, secret

log = logging.getLogger("tidal.gateway")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class BodyLimit:
    """Refuse bodies over max_bytes with 413 before anything reads them (declared or streamed size)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            declared_ok(scope, self.max_bytes)
        except BodyTooLarge:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise GatewayError(413, "body too large")
            return message

        try:
            await self.app(scope, limited, send)
        except GatewayError:
            await self._refuse(send)

    async def _refuse(self, send):
        body = too_large_body(self.max_bytes)
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def build_app(gw: Gateway, clients: dict[str, str], admin: str, limiter: RateLimiter, max_body_bytes: int) -> CompletionPlane:
    """The gateway's ASGI app: the completion endpoints' data plane (serving/data_plane.py) in front of the FastAPI
    app that serves the rest. clients: sha256(key) → client id."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="Tidal gateway", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError):
        # Labelled by route template, never the raw path: one series per random path would grow without bound.
        route = request.scope.get("route")
        gw.metrics.requests.labels(getattr(route, "path", "unmatched"), str(exc.status)).inc()
        return Response(error_body(exc.status, exc.message), exc.status, exc.headers, "application/json")

    @app.exception_handler(ValidationError)
    async def invalid_value(request: Request, exc: ValidationError):
        # A model built inside a handler (e.g. the new routes) refused the values: the client's mistake.
        return Response(error_body(422, invalid_values(exc)), status_code=422, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        # FastAPI's shape, without the offending input: it may be bytes, NaN or a secret (serving/data_plane.py)
        return Response(detail_body(exc.errors()), status_code=422, media_type="application/json")

    @app.exception_handler(RouteError)
    async def route_error(request: Request, exc: RouteError):
        code = 409 if isinstance(exc, CanaryGone) else 400
        return Response(error_body(code, str(exc)), status_code=code, media_type="application/json")

    # async dependencies: FastAPI runs plain `def` ones in a thread pool, a hand-off per request.
    async def authenticate(authorization: str) -> str:
        client_id = clients.get(_digest(bearer(authorization)))
        if client_id is None:
            raise GatewayError(401, "missing or unknown API key (Authorization: Bearer <key>)")
        wait = limiter.take(client_id)
        if wait > 0:
            gw.metrics.rate_limited.labels(client_id).inc()
            raise GatewayError(
                429,
                f"rate limit of {limiter.rate:g} requests/s exceeded; retry in {wait * 1000:.0f} ms",
                {"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return client_id

    async def client(authorization: str = Header("", description="Bearer <client API key>")) -> str:
        return await authenticate(authorization)

    async def admin_only(authorization: str = Header("", description="Bearer <admin token>")) -> None:
        if not admin_authorized(authorization, admin):
            raise GatewayError(401, "missing or wrong admin token")

    def answer(result, endpoint: str):
        gw.metrics.requests.labels(endpoint, "200").inc()
        if isinstance(result, tuple):  # (stream, meta)
            stream, meta = result
            return StreamingResponse(stream, media_type="text/event-stream", headers=meta)
        meta = {"X-Tidal-Request-Id": result["tidal"]["request_id"], "X-Tidal-Version": str(result["tidal"]["version"])}
        return Response(orjson.dumps(result), media_type="application/json", headers=meta)

    async def completions(req: CompletionRequest, client_id: str = Depends(client)):
        return answer(await gw.complete(req, client_id), "/v1/completions")

    async def chat_completions(req: ChatRequest, client_id: str = Depends(client)):
        return answer(await gw.complete(req, client_id, chat=True), "/v1/chat/completions")

    # The schema of the two endpoints, and their handlers where this FastAPI app is mounted alone; the gateway
    # answers them in its data plane (serving/data_plane.py), in front of this app.
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)

    @app.post("/v1/feedback", response_model=FeedbackResponse)
    async def feedback(req: FeedbackRequest, client_id: str = Depends(client)) -> FeedbackResponse:
        event = await gw.feedback(req, client_id)
        gw.metrics.requests.labels("/v1/feedback", "200").inc()
        return FeedbackResponse(request_id=event.request_id, event=event.event)

    @app.get("/v1/models")
    async def models(client_id: str = Depends(client)) -> dict:
        names = sorted(set(gw.routes.all()) | set(gw.pool.snapshot.serving_version))
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "tidal"} for n in names]}

    @app.get("/health")
    async def health() -> JSONResponse:
        stuck = gw.wal_stuck_since
        body = {
            "ok": stuck is None,
            "fleet": gw.pool.last_error or "ok",
            "replica_names": len(gw.pool.snapshot.by_served_name),
            "wal": "ok"
            if stuck is None
            else f"appends not durable within {gw.limits.wal_append_timeout_s:g} s for {time.time() - stuck:.0f} s",
        }
        return JSONResponse(body, status_code=200 if stuck is None else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/routes", dependencies=[Depends(admin_only)])
    async def get_routes() -> RouteTableReply:
        return RouteTableReply(routes=gw.routes.all(), history=gw.routes.history[-50:])

    def require_served(model: str, versions: list[int]) -> None:
        for v in versions:
            if not gw.pool.snapshot.by_served_name.get(f"{model}@v{v}"):
                raise GatewayError(
                    409, f"{model}@v{v} is not served by any ready (verified) replica; deploy it to the fleet first"
                )

    @app.put("/admin/routes/{model}", dependencies=[Depends(admin_only)])
    async def put_routes(model: str, body: RoutesUpdate) -> dict:
        require_served(model, [a.version for a in body.arms])
        routes = ModelRoutes(model=model, arms=body.arms, updated_ms=now_ms(), updated_by=body.by, reason=body.reason)
        return gw.routes.set(routes).model_dump()

    @app.post("/admin/routes/{model}/canary", dependencies=[Depends(admin_only)])
    async def set_canary(model: str, body: CanaryUpdate) -> dict:
        require_served(model, [body.version])
        if gw.routes.get(model) is None:  # first change: start from the fleet's default control arm
            gw.routes.set(gw.model_routes(model))
        return gw.routes.set_weights(model, body.version, body.weight, body.by, body.reason, watch_s=body.watch_s).model_dump()

    @app.post("/admin/routes/{model}/canary/watch", dependencies=[Depends(admin_only)])
    async def watch_canary(model: str, body: CanaryWatch) -> dict:
        return (await asyncio.to_thread(gw.routes.watch, model, body.version, body.watch_s)).model_dump()

    @app.post("/admin/routes/{model}/rollback", dependencies=[Depends(admin_only)])
    async def rollback(model: str, body: RollbackRequest) -> dict:
        return gw.routes.rollback(model, body.by, body.reason).model_dump()

    return CompletionPlane(gw, authenticate, max_body_bytes, fallback=app)


def build_gateway(settings: ServingSettings) -> tuple[CompletionPlane, ServingSettings]:
    g = settings.gateway
    sink = LogSink(settings.data_path / "wal", open_store(settings), g.logsink)
    metrics = GatewayMetrics(sink.metrics, settings.collect.rule_for)
    key = secret(settings.data_path, "request_id", g.secret).encode()  # signs request ids and keys user hashes
    gw = Gateway(
        routes=RouteTable(settings.data_path / "gateway" / "routes.json", g.route_limits),
        pool=ReplicaPool(
            f"http://{settings.fleet.host}:{settings.fleet.admin_port}",
            admin_token(settings),
            g.fleet_poll_s,
            max_in_flight=g.max_in_flight_per_replica,
            call_limit_s=g.upstream_timeout_s,
        ),
        sink=sink,
        signer=RequestIdSigner(key),
        user_secret=key,
        limits=Limits(
            g.max_prompt_chars,
            g.max_tokens,
            int(g.feedback_window_s * 1000),
            g.upstream_timeout_s,
            g.connect_timeout_s,
            g.first_byte_timeout_s,
            g.wal_append_timeout_s,
            {m.name: m.feedback for m in settings.models},
        ),
        metrics=metrics,
    )
    clients = {_digest(c.key): c.client_id for c in client_keys(settings)}
    return build_app(
        gw, clients, admin_token(settings), RateLimiter(g.rate_limit_rps, g.rate_limit_burst), g.max_body_bytes
    ), settings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_serving_settings()
    app, _ = build_gateway(settings)
    uvicorn.run(
        app,
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_level="warning",
        http=GatewayHttpProtocol,  # uvicorn's httptools protocol, a response's writes sent as one
        loop="uvloop",
        access_log=False,
        proxy_headers=False,
        server_header=False,
    )


if __name__ == "__main__":
    main()
