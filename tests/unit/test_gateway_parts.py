"""Gateway pieces that need no servers: the rate limiter, the body limit, the replica pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.gateway import GatewayError
from serving.gateway_app import BodyLimit
from serving.gateway_metrics import RateLimiter
from serving.upstream import NoReplica, ReplicaPool


def test_rate_limiter_allows_a_burst_then_says_when_to_retry():
    limiter = RateLimiter(rate=10.0, burst=3)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.take("a")
    assert 0.0 < wait <= 0.1 + 1e-9  # one token refills in 1/rate s
    assert limiter.take("b") == 0.0  # buckets are per client
    time.sleep(wait + 0.01)
    assert limiter.take("a") == 0.0


def _run_body_limit(body_chunks: list[bytes], declared: int | None, max_bytes: int):
    sent, reached = [], []

    async def app(scope, receive, send):
        while True:
            msg = await receive()
            reached.append(msg)
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1} for i, c in enumerate(body_chunks)]

    async def receive():
        return messages.pop(0)

    async def send(msg):
        sent.append(msg)

    headers = [(b"content-length", str(declared).encode())] if declared is not None else []
    asyncio.run(BodyLimit(app, max_bytes)({"type": "http", "headers": headers}, receive, send))
    return sent[0]["status"], reached


def test_body_limit_refuses_declared_and_streamed_oversize():
    assert _run_body_limit([b"x" * 10], 10, 100)[0] == 200
    status, reached = _run_body_limit([b"x" * 10], 1000, 100)
    assert status == 413 and reached == []  # refused before the app read anything
    status, _ = _run_body_limit([b"x" * 60, b"x" * 60], None, 100)  # chunked, no length declared
    assert status == 413


def test_pool_rotates_ready_replicas_and_puts_failed_ones_last():
    pool = ReplicaPool("http://unused", "t", poll_s=1.0, penalty_s=30.0)
    pool.apply({"models": {"tab": {"serving_version": 1, "replicas": [
        {"name": "tab-0", "state": "ready", "url": "http://a", "served": {"tab@v1": 1, "tab@v2": 2}},
        {"name": "tab-1", "state": "ready", "url": "http://b", "served": {"tab@v1": 1}},
        {"name": "tab-2", "state": "starting", "url": "http://c", "served": {"tab@v1": 1}}]}}})
    assert pool.snapshot.serving_version == {"tab": 1}
    firsts = {pool.candidates("tab@v1")[0].replica for _ in range(4)}
    assert firsts == {"tab-0", "tab-1"}  # round robin, never the starting replica
    assert [e.replica for e in pool.candidates("tab@v2")] == ["tab-0"]
    pool.penalize("tab-0")
    assert [pool.candidates("tab@v1")[0].replica for _ in range(3)] == ["tab-1"] * 3
    with pytest.raises(NoReplica, match="tab@v9"):
        pool.candidates("tab@v9")


def test_gateway_error_carries_status_and_headers():
    e = GatewayError(429, "slow down", {"Retry-After": "1"})
    assert (e.status, e.message, e.headers) == (429, "slow down", {"Retry-After": "1"})
