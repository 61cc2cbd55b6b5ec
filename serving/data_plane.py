"""The completion endpoints as a raw ASGI app in front of the gateway's FastAPI app.

Every request for POST /v1/completions or /v1/chat/completions is answered here; anything else goes on to the
FastAPI app (feedback, models, health, metrics, admin). The FastAPI app still declares the two endpoints, for the
OpenAPI schema and for a server that mounts it alone; both call Gateway.complete.

Why: FastAPI and Starlette's per-request chain (seven middleware and routing layers, a Request object, a response
class, a task group for each stream) was about a third of the gateway's CPU per completion under load (py-spy,
bench/gateway.py --profile), CPU taken from the engines on shared cores. The promises stay the same (tests:
tests/unit/test_data_plane.py, test_gateway_parts.py, the gateway's integration and chaos tests): the body limit
(413 before parsing), authentication and the rate limit before the body is parsed, 422 naming the field (FastAPI's
`detail` shape, never the input), the gateway's error replies and their metric labels, a streamed completion
cancelled when its client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import orjson
from pydantic import ValidationError

from serving.api_models import ChatRequest, CompletionRequest
from serving.gateway import Gateway, GatewayError

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
Authenticate = Callable[[str], Awaitable[str]]  # the Authorization header's value → client id, or GatewayError
# path → (body model, chat?)
ENDPOINTS: dict[str, tuple[type, bool]] = {
    "/v1/completions": (CompletionRequest, False),
    "/v1/chat/completions": (ChatRequest, True),
}


class BodyTooLarge(Exception):
    """A request body over the gateway's limit, declared or streamed."""


class ClientGone(Exception):
    """The client disconnected before its request body arrived: there is nobody to answer."""


def error_body(status: int, message: str) -> bytes:
    """The gateway's error reply (OpenAI's shape)."""
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})


def too_large_body(max_bytes: int) -> bytes:
    return error_body(413, f"request body exceeds {max_bytes} bytes")


def invalid_values(e: ValidationError) -> str:
    """A pydantic refusal as one line: each field and why."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())


def detail_body(errors: Iterable[dict], prefix: tuple = ()) -> bytes:
    """422 naming each field, as FastAPI words it (`detail`: type, loc, msg), without the offending input: it may be
    bytes, NaN or a secret, none of which belongs in a reply. prefix: put before each loc (("body",) for a body
    that pydantic parsed itself)."""
    return orjson.dumps({"detail": [{"type": e["type"], "loc": [*prefix, *e["loc"]], "msg": e["msg"]} for e in errors]})


def declared_ok(scope: dict, max_bytes: int) -> None:
    """BodyTooLarge for a declared Content-Length over max_bytes (or not a number), before anything is read."""
    for name, value in scope["headers"]:
        if name == b"content-length" and (not value.isdigit() or int(value) > max_bytes):
            raise BodyTooLarge


async def read_body(receive: Callable, max_bytes: int) -> bytes:
    """The whole request body; BodyTooLarge as soon as the received size passes max_bytes."""
    chunks, seen = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        seen += len(body)
        if seen > max_bytes:
            raise BodyTooLarge
        chunks.append(body)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def header(scope: dict, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


async def send_bytes(send: Callable, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def meta_headers(meta: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in meta.items()]


class CompletionPlane:
    """ASGI app: the completion endpoints, then `fallback` (the FastAPI app) for everything else."""

    def __init__(self, gw: Gateway, authenticate: Authenticate, max_body_bytes: int, fallback: ASGIApp):
        self.gw, self.authenticate, self.max_body_bytes, self.fallback = gw, authenticate, max_body_bytes, fallback
        self.ok: dict[str, object] = {}  # path → its 200s counter, looked up once (made on first use: no empty series)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.fallback(scope, receive, send)
        path, (model, chat) = scope["path"], endpoint
        try:
            declared_ok(scope, self.max_body_bytes)  # as the body limit did ahead of everything else
            client_id = await self.authenticate(header(scope, b"authorization"))
            body = await read_body(receive, self.max_body_bytes)
            try:
                req = model.model_validate_json(body)
            except ValidationError as e:
                return await send_bytes(send, 422, detail_body(e.errors(include_url=False, include_context=False), ("body",)))
            result = await self.gw.complete(req, client_id, chat=chat)
        except BodyTooLarge:
            return await send_bytes(send, 413, too_large_body(self.max_body_bytes))
        except ClientGone:
            return None
        except GatewayError as e:
            self.gw.metrics.requests.labels(path, str(e.status)).inc()
            return await send_bytes(send, e.status, error_body(e.status, e.message), meta_headers(e.headers))
        except ValidationError as e:  # a model built while serving refused its values (the FastAPI app's rule too)
            return await send_bytes(send, 422, error_body(422, invalid_values(e)))
        ok = self.ok.get(path) or self.ok.setdefault(path, self.gw.metrics.requests.labels(path, "200"))
        ok.inc()
        if isinstance(result, tuple):
            stream, meta = result
            return await self.relay(stream, meta, receive, send)
        rid, version = result["tidal"]["request_id"], result["tidal"]["version"]
        ids = [(b"x-tidal-request-id", rid.encode()), (b"x-tidal-version", b"%d" % version)]
        await send_bytes(send, 200, orjson.dumps(result), ids)

    async def relay(self, stream: AsyncIterator[bytes], meta: dict[str, str], receive: Callable, send: Callable) -> None:
        """Server-sent events to the client; a client that goes away cancels the stream (its engine call is closed,
        so the engine stops generating for nobody)."""

        async def forward() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), *meta_headers(meta)],
                }
            )
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relay, gone = asyncio.ensure_future(forward()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
            await stream.aclose()
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()
