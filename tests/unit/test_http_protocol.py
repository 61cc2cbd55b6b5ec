"""The gateway's HTTP protocol (serving/http_protocol.py): the writes of one event-loop iteration leave as one send,
and the real uvicorn server on it answers, keeps connections alive, and streams."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from serving.http_protocol import CoalescingTransport, GatewayHttpProtocol


class Recorder:
    """The socket side of a transport, as far as these tests look: what was sent, in how many sends."""

    def __init__(self):
        self.sends, self.closed, self.aborted = [], False, False

    def write(self, data: bytes) -> None:
        self.sends.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed


def test_writes_in_one_iteration_leave_as_one_send_and_close_sends_what_is_held():
    async def main():
        rec = Recorder()
        t = CoalescingTransport(rec, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"ok")
        assert rec.sends == []  # held until the iteration ends
        await asyncio.sleep(0)
        assert rec.sends == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
        t.write(b"a")
        await asyncio.sleep(0)
        t.write(b"b")
        t.close()  # sends what it holds, then closes
        assert rec.sends[1:] == [b"a", b"b"] and rec.closed and t.is_closing()
        t.write(b"dropped")
        t.abort()
        await asyncio.sleep(0)
        assert rec.sends[-1] == b"b" and rec.aborted

    asyncio.run(main())


def test_uvicorn_on_the_protocol_answers_in_one_segment_keeps_alive_and_streams():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(3):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=GatewayHttpProtocol, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def client():
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        first = []
        for _ in range(2):  # twice on one connection: kept alive
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            first.append(await reader.read(65536))  # one send: headers and body in the first read
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        streamed = b""
        while not streamed.endswith(b"0\r\n\r\n"):
            streamed += await reader.read(65536)
        writer.close()
        server.should_exit = True
        return first, streamed

    async def main():
        serve = asyncio.create_task(server.serve())
        try:
            return await asyncio.wait_for(client(), 20)
        finally:
            server.should_exit = True
            await serve

    first, streamed = asyncio.run(main())
    assert all(r.startswith(b"HTTP/1.1 200 OK\r\n") and r.endswith(b"\r\n\r\nok") for r in first), first
    assert streamed.startswith(b"HTTP/1.1 200 OK\r\n") and all(b"data: %d\n\n" % i in streamed for i in range(3))
