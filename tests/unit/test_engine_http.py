"""The gateway's engine client (serving/engine_http.py) against scripted HTTP servers on 127.0.0.1: keep-alive,
sized and chunked bodies, and each failure a caller must tell apart for failover."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from serving.engine_http import BrokenOff, ConnectFailed, EngineClient, StaleConnection

ANSWER = b'{"choices": [{"text": "ab"}]}'


def sized(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


def chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return out + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class Script:
    """An HTTP server whose handler reads each request and then runs `answer(writer, n)` (n: the request's number
    on this server); it counts connections and sees when the client closes one."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests, self.eof = answer, 0, [], asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
                self.requests.append((head, await reader.readexactly(length)))
                if await self.answer(writer, len(self.requests)) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof.set()  # the client closed the connection
        except asyncio.CancelledError:  # the server closes at the test's end
            writer.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_calls_share_one_kept_alive_connection_and_send_one_prebuilt_request():
    async def answer(writer, n):
        writer.write(sized())

    async def main():
        script = Script(answer)
        async with script as url:
            client = EngineClient(connect_timeout_s=2, total_s=10)
            bodies = []
            for _ in range(3):
                async with await client.post(url, "/v1/completions", b'{"prompt": "x"}', first_byte_s=5) as r:
                    bodies.append((r.status, await r.read()))
            client.close()
        return script, bodies

    script, bodies = run(main())
    assert bodies == [(200, ANSWER)] * 3
    assert script.connections == 1
    head, body = script.requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Content-Type: application/json" in head
    assert body == b'{"prompt": "x"}'


def test_a_chunked_stream_comes_in_whole_lines_across_chunk_boundaries_and_in_batches():
    events = [b'data: {"a": 1}\n\n', b'data: {"b"', b": 2}\n\ndata: [DONE]\n\n"]

    async def answer(writer, n):
        writer.write(chunked(*events))

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, 10)
            async with await client.post(url, "/v1/completions", b"{}", 5) as r:
                batches = [batch async for batch in r.line_batches()]
            client.close()
        return batches

    batches = run(main())
    assert [line for batch in batches for line in batch] == [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]", b""]
    assert len(batches) < 6  # what arrived together comes together


def test_a_last_line_without_a_newline_still_comes():
    async def answer(writer, n):
        writer.write(chunked(b"data: x\n", b"tail"))

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, 10)
            async with await client.post(url, "/", b"{}", 5) as r:
                lines = [line async for batch in r.line_batches() for line in batch]
            client.close()
        return lines

    assert run(main()) == [b"data: x", b"tail"]


def test_a_refused_connection_is_connect_failed():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        await EngineClient(2, 10).post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", 5)

    with pytest.raises(ConnectFailed, match="cannot connect"):
        run(main())


def test_a_kept_alive_connection_the_engine_closed_is_stale_not_broken():
    """The engine closed an idle keep-alive connection (its own timeout) just as the client reused it: the request
    went out, nothing came back. The caller may retry at once without holding it against the replica."""

    async def answer(writer, n):
        if n == 1:
            writer.write(sized())
        else:
            return "close"  # the second request on that connection meets the engine's close

    async def main():
        script = Script(answer)
        async with script as url:
            client = EngineClient(2, 10)
            async with await client.post(url, "/", b"{}", 5) as r:
                await r.read()
            with pytest.raises(StaleConnection):
                await client.post(url, "/", b"{}", 5)
            client.close()

    run(main())


def test_no_headers_within_first_byte_s_is_a_timeout_and_the_connection_is_closed():
    async def answer(writer, n):
        await asyncio.sleep(30)  # a hung engine

    async def main():
        script = Script(answer)
        async with script as url:
            client = EngineClient(2, 60)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer within 0.3 s"):
                await client.post(url, "/", b"{}", first_byte_s=0.3)
            elapsed = time.monotonic() - t0
            client.close()
        return elapsed

    assert 0.25 < run(main()) < 5


def test_a_body_past_total_s_is_a_timeout_for_its_reader():
    async def answer(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")  # then nothing more

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, total_s=0.5)
            r = await client.post(url, "/", b"{}", 5)
            with pytest.raises(TimeoutError, match="longer than 0.5 s"):
                await r.read()
            r.release()
            client.close()

    run(main())


def test_an_engine_dying_after_its_headers_is_broken_off():
    async def answer(writer, n):
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"cho')
        return "close"

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, 10)
            r = await client.post(url, "/", b"{}", 5)
            with pytest.raises(BrokenOff):
                await r.read()
            r.release()
            assert not client._idle.get(url)  # a broken connection is never reused
            client.close()

    run(main())


def test_a_response_abandoned_mid_stream_closes_its_connection():
    """A client gone mid-stream: the engine must see the connection close, so it stops generating for nobody."""

    async def answer(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()  # raises once the client has closed the connection
            await asyncio.sleep(0.05)

    async def main():
        script = Script(answer)
        async with script as url:
            client = EngineClient(2, 10)
            async with await client.post(url, "/", b"{}", 5) as r:
                async for _ in r.line_batches():
                    break
            await asyncio.wait_for(script.eof.wait(), 5)
            assert not client._idle.get(url)
            client.close()

    run(main())


def test_a_response_that_is_not_http_is_broken_off():
    async def answer(writer, n):
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, 10)
            with pytest.raises(BrokenOff, match="not valid HTTP"):
                await client.post(url, "/", b"{}", 5)
            client.close()

    run(main())


def test_idle_connections_past_their_time_are_dropped_not_kept():
    async def answer(writer, n):
        writer.write(sized())

    async def main():
        async with Script(answer) as url:
            client = EngineClient(2, 10)
            responses = [await client.post(url, "/", b"{}", 5) for _ in range(3)]  # three connections at once
            for r in responses:
                await r.read()
                r.release()
            assert len(client._idle[url]) == 3
            for conn in client._idle[url][:2]:
                conn.idle_since -= 60  # idle for a minute
            r = await client.post(url, "/", b"{}", 5)  # reuses the freshest
            await r.read()
            r.release()
            assert len(client._idle[url]) == 1 and not client._idle[url][0].closed
            client.close()

    run(main())
