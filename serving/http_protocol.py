"""The gateway's HTTP server protocol: uvicorn's (httptools), with the writes made in one event-loop iteration sent
in one `send`.

uvicorn writes a response's status line and headers, then its body, as two sends. On loopback each send costs the
sender ~25-30 µs of CPU on this kind of VM and wakes the client once more (the client reads the headers, sleeps,
and is woken again for the body); at concurrency 1 the gateway's sends to its clients were 60% of its CPU
(py-spy, bench/gateway.py --profile). Held until the loop has run the iteration's ready callbacks, the headers and
the body of a response, or the events of a stream that arrived together, leave as one. Nothing waits longer than
that iteration: the flush is the next callback the loop runs.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes are gathered until the end of the current loop iteration, then sent as one.
    close() sends what is gathered first; abort() drops it."""

    __slots__ = ("_transport", "_loop", "_pending", "_scheduled")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        self._scheduled = False
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str):  # is_closing, get_extra_info, pause_reading, resume_reading, ...
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a CoalescingTransport (`uvicorn.run(..., http=GatewayHttpProtocol)`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
