"""The completion endpoints' data plane (serving/data_plane.py) in front of the FastAPI app: the body limit before
anything else, the FastAPI app reached for every other route with the same error shapes, and a streamed completion
whose client goes away cancelled down to the engine's connection."""

from __future__ import annotations

import asyncio
import hashlib

import orjson
from fastapi.testclient import TestClient

from serving.gateway_app import build_app
from serving.gateway_metrics import RateLimiter
from serving.upstream import ReplicaPool
from tests.unit.test_gateway_parts import _gateway, fleet, replica

AUTH = {"Authorization": "Bearer alice-key-0123456789"}


def app_for(gw):
    clients = {hashlib.sha256(b"alice-key-0123456789").hexdigest(): "alice"}
    return build_app(gw, clients, "admin-token-0123456789", RateLimiter(100, 100), 4096)


def test_a_body_over_the_limit_is_refused_before_authentication_or_parsing(tmp_path):
    client = TestClient(app_for(_gateway(tmp_path)))
    big = b'{"model": "tab", "prompt": "' + b"x" * 5000 + b'"}'
    for headers in (AUTH, {"Authorization": "Bearer wrong"}):  # declared too large: 413 whoever asks
        r = client.post("/v1/completions", content=big, headers=headers)
        assert r.status_code == 413 and r.json()["error"]["message"] == "request body exceeds 4096 bytes"

    def chunks():  # no declared length: counted as it arrives
        for _ in range(5):
            yield b"x" * 1000

    r = client.post("/v1/completions", content=chunks(), headers=AUTH)
    assert r.status_code == 413


def test_every_other_route_reaches_the_fastapi_app_and_its_422_never_echoes_the_input(tmp_path):
    client = TestClient(app_for(_gateway(tmp_path)))
    assert client.get("/health").json()["ok"] is True
    assert client.get("/v1/completions").status_code == 405  # only POST is the data plane's
    r = client.post("/v1/feedback", json={"request_id": "sk-secret-value", "event": "sk-other-secret"}, headers=AUTH)
    assert r.status_code == 422 and "sk-other-secret" not in r.text
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "event"]]
    assert "/v1/completions" in client.get("/openapi.json").json()["paths"]  # still documented


class SlowStream:
    """An engine on 127.0.0.1 streaming one event every 50 ms for 5 s; records when the gateway closes on it."""

    def __init__(self):
        self.closed = asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        event = orjson.dumps({"choices": [{"text": "ab", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}]})
        line = b"data: " + event + b"\n\n"
        try:
            for _ in range(100):
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            self.closed.set()
        finally:
            writer.close()


def test_a_client_gone_mid_stream_cancels_it_down_to_the_engine(tmp_path):
    """The client disconnects after the first event: the relay stops, the engine's connection is closed (the engine
    stops generating for nobody), the replica's in-flight count is back to 0, and nothing is logged as served."""

    async def main():
        engine = SlowStream()
        async with engine as url:
            pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0)
            pool.apply(fleet(replica("tab-0", url, {"tab@v1": 1})))
            gw = _gateway(tmp_path, pool)
            gw.sink.start()
            app, sent, first_event = app_for(gw), [], asyncio.Event()
            body = orjson.dumps({"model": "tab", "prompt": "x", "max_tokens": 64, "stream": True})
            requests = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                if requests:
                    return requests.pop()
                await first_event.wait()
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)
                if message.get("body", b"").startswith(b"data: {"):
                    first_event.set()

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "headers": [(b"authorization", AUTH["Authorization"].encode())],
            }
            await asyncio.wait_for(app(scope, receive, send), 5)
            await asyncio.wait_for(engine.closed.wait(), 5)
            in_flight = pool.in_flight("tab-0")
            gw.engines.close()
            await asyncio.to_thread(gw.sink.stop)
        return sent, in_flight, list(gw.sink.iter_recent("completions"))

    sent, in_flight, logged = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream") in sent[0]["headers"]
    assert not any(m.get("body", b"").startswith(b"data: [DONE]") for m in sent)
    assert in_flight == 0 and logged == []


def test_an_engine_answer_that_outlasts_the_upstream_timeout_is_a_504_naming_the_setting(tmp_path):
    from fastapi.testclient import TestClient

    from serving.gateway import Limits

    async def stall(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")  # headers, then the body never comes
        await asyncio.sleep(30)

    import threading

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(stall, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0)
        pool.apply(fleet(replica("tab-0", url, {"tab@v1": 1})))
        gw = _gateway(tmp_path, pool, Limits(1000, 64, 60_000, upstream_timeout_s=0.5, first_byte_timeout_s=0.5))
        r = TestClient(app_for(gw)).post("/v1/completions", json={"model": "tab", "prompt": "x"}, headers=AUTH)
        assert r.status_code == 504, r.text
        assert "gateway.upstream_timeout_s" in r.json()["error"]["message"]
        assert pool.in_flight("tab-0") == 0
    finally:

        async def shutdown():
            server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_client_gone_before_its_body_arrives_gets_nothing_and_logs_no_error(tmp_path, caplog):
    gw = _gateway(tmp_path)
    sent = []
    messages = [{"type": "http.request", "body": b'{"model": "ta', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", AUTH["Authorization"].encode())],
    }
    asyncio.run(app_for(gw)(scope, receive, send))
    assert sent == [] and not [r for r in caplog.records if r.levelname == "ERROR"]
