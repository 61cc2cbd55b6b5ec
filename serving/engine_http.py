"""The gateway's HTTP/1.1 client to its engines: keep-alive connections per replica, each an asyncio protocol
fed to httptools' response parser (the C parser uvicorn serves with).

Why not aiohttp: per engine call, aiohttp built a request object, its headers, a timer context, a response object
and a stream reader, about a fifth of the gateway's CPU per completion under load (py-spy, bench/gateway.py
--profile), CPU taken from the engines on shared cores. Here a call is one `write` of a prebuilt request and a
parser feeding bytes to the reader; the body is handed over as it arrives (chunked or sized, as the engine sends).

What a caller can tell apart, for failover (serving/gateway.py call_engine):
  ConnectFailed     no connection within connect_timeout_s, or refused: the replica is down;
  StaleConnection   a kept-alive connection closed before any answer (the engine timed it out as it was reused):
                    retry, the replica is fine;
  BrokenOff         the connection died or the answer could not be parsed after the call was sent;
  TimeoutError      no response headers within the call's first_byte_s, or the whole call past total_s.
A response read to its end goes back to the pool; one abandoned part-way (a client gone mid-stream) is closed, so
the engine stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

IDLE_S = 3.0  # an idle connection is dropped before the engines' own keep-alive timeout (uvicorn, vLLM: 5 s)
HIGH_WATER = 1 << 20  # bytes of unread body at which reading from the engine pauses (a slow client's stream)


class EngineCallError(Exception):
    """A call to an engine that failed on the wire."""


class ConnectFailed(EngineCallError):
    """No connection to the replica (refused, unreachable, or not within the connect timeout)."""


class StaleConnection(EngineCallError):
    """A reused keep-alive connection closed before the engine answered; a new connection will do."""


class BrokenOff(EngineCallError):
    """The connection died, or the engine's answer was not valid HTTP, after the request was sent."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one call on it at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.reused = False  # it answered a call before: a close before any answer is a StaleConnection
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.got_bytes = False
        self.complete = False
        self.keep_alive = False  # the parser's verdict at the end of the answer (it resets right after)
        self.error: EngineCallError | TimeoutError | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None  # set while a reader waits for headers, body or the end

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.fail(BrokenOff(f"the engine's answer is not valid HTTP: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:  # (an idle connection's last call is complete: nothing to fail)
            kind = StaleConnection if self.reused and not self.got_bytes else BrokenOff
            self.fail(kind(f"connection closed by the engine{f': {exc}' if exc else ''}"))

    # ---- httptools callbacks -------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # HTTP/1.1 without `Connection: close`
        self.complete = True
        self._wake()

    # ---- the call --------------------------------------------------------------------------------
    def fail(self, error: EngineCallError | TimeoutError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        """Until the parser or the connection has news; raises the call's error if it has one."""
        if self.error is not None:
            raise self.error
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        """The body received so far (and reading resumed if it was paused)."""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks, self.buffered = [], 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()  # at once: the engine sees the disconnect and aborts the request


class EngineResponse:
    """An engine's answer: status, then the body read whole (`read`) or as it comes (`line_batches`). Use it as an async
    context manager, or call `release()`: a response read to its end gives its connection back to the pool."""

    def __init__(self, pool: EngineClient, key: str, conn: _Connection, timer: asyncio.TimerHandle):
        self._pool, self._key, self._conn, self._timer = pool, key, conn, timer
        self.status = conn.status

    async def read(self) -> bytes:
        conn, parts = self._conn, []
        while not conn.complete:
            parts.append(conn.take())
            await conn.wait()
        parts.append(conn.take())
        return b"".join(parts)

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body as lines (server-sent events) without their newline, in batches: every complete line that has
        arrived, at once, so a relay under load handles several events per wake-up and writes them together.
        A last line without a newline comes too."""
        conn, rest = self._conn, b""
        while True:
            data = rest + conn.take()
            *done, rest = data.split(b"\n")
            if conn.complete:
                if rest:
                    done.append(rest)
                if done:
                    yield done
                return
            if done:
                yield done
            await conn.wait()

    async def text(self, limit: int = 4096) -> str:
        return (await self.read())[:limit].decode("utf-8", "replace")

    def release(self) -> None:
        self._timer.cancel()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and conn.error is None and not conn.closed and conn.keep_alive:
            self._pool._give_back(self._key, conn)
        else:
            conn.close()

    async def __aenter__(self) -> EngineResponse:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class EngineClient:
    """Keep-alive connections to the engines, per replica URL. `post` returns once the response headers arrived."""

    def __init__(self, connect_timeout_s: float, total_s: float):
        self.connect_timeout_s, self.total_s = connect_timeout_s, total_s
        self._idle: dict[str, list[_Connection]] = {}  # "http://host:port" → idle connections, last used last

    async def post(self, base_url: str, path: str, body: bytes, first_byte_s: float) -> EngineResponse:
        """POST body (JSON) to base_url + path; the response once its headers arrived, within first_byte_s of the
        call (connecting included). The whole call, headers and body, is bounded by total_s. Past either bound the
        connection is aborted and the caller, or the body's reader, gets TimeoutError. (Timers on the loop rather
        than asyncio.wait_for, which starts a task per call.)"""
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = await self._connection(base_url, first_byte_s)
        conn._reset()
        host = base_url.split("//", 1)[1]
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        timer = loop.call_at(started + self.total_s, self._expire, conn, f"the engine call took longer than {self.total_s:g} s")
        headers_due = loop.call_at(started + first_byte_s, self._expire, conn, f"no answer within {first_byte_s:g} s")
        try:
            conn.transport.write(head + body)
            while not conn.status:
                await conn.wait()
        except BaseException:
            timer.cancel()
            conn.close()
            raise
        finally:
            headers_due.cancel()
        return EngineResponse(self, base_url, conn, timer)

    @staticmethod
    def _expire(conn: _Connection, why: str) -> None:
        conn.fail(TimeoutError(why))
        conn.close()

    async def _connection(self, base_url: str, within_s: float) -> _Connection:
        idle, now = self._idle.get(base_url), time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                conn.reused = True
                return conn
            conn.close()
        url = urlsplit(base_url)
        try:
            _, conn = await asyncio.wait_for(
                asyncio.get_running_loop().create_connection(_Connection, url.hostname, url.port),
                min(self.connect_timeout_s, within_s),
            )
        except TimeoutError:
            raise ConnectFailed(f"no connection to {base_url} within {min(self.connect_timeout_s, within_s):g} s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {base_url}: {e.strerror or e}") from None
        return conn

    def _give_back(self, base_url: str, conn: _Connection) -> None:
        now = time.monotonic()
        conn.idle_since = now
        idle = self._idle.setdefault(base_url, [])
        # the oldest come first: those the engine closed or that idled too long go (a replica gone keeps none)
        while idle and (idle[0].closed or now - idle[0].idle_since >= IDLE_S):
            idle.pop(0).close()
        idle.append(conn)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
