"""Gateway metrics (Prometheus, one registry per gateway instance) and the per-client rate limiter."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class GatewayMetrics:
    def __init__(self, sink_metrics):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gateway_requests", "Requests answered", ["endpoint", "code"], registry=r)
        self.completions = Counter("gateway_completions", "Completions logged", ["model", "arm"], registry=r)
        self.latency = Histogram(
            "gateway_latency_ms",
            "Receive to last byte, logged completions",
            ["model", "arm"],
            buckets=LATENCY_BUCKETS_MS,
            registry=r,
        )
        self.errors = Counter(
            "gateway_completion_errors", "Completions routed to an arm that failed (5xx)", ["model", "arm"], registry=r
        )
        self.failovers = Counter("gateway_upstream_failovers", "Replica failures before the first byte", ["model"], registry=r)
        self.feedback = Counter("gateway_feedback", "Feedback events by outcome", ["outcome"], registry=r)
        self.withheld = Counter(
            "gateway_withheld",
            "Completions the served version's suggestion filter withheld (the client got an empty one)",
            ["model", "arm"],
            registry=r,
        )
        self.watchdog = Counter(
            "gateway_canary_watchdog_rollbacks",
            "Canaries rolled back because their release stopped checking in",
            ["model"],
            registry=r,
        )
        self.rate_limited = Counter("gateway_rate_limited", "Requests refused by the rate limiter", ["client"], registry=r)
        self._wal = Gauge(
            "gateway_wal", "Log sink state (wal_bytes, segments_pending, wal_over_cap, ...)", ["figure"], registry=r
        )
        self._sink_metrics = sink_metrics

    def observe(self, model: str, arm: str, latency_ms: float) -> None:
        self.completions.labels(model, arm).inc()
        self.latency.labels(model, arm).observe(latency_ms)

    def render(self) -> bytes:
        for key, value in self._sink_metrics().items():
            self._wal.labels(key).set(float(value))
        return generate_latest(self.registry)


class RateLimiter:
    """Token bucket per client: `rate` requests/s sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # client → (tokens, monotonic time)

    def take(self, client: str) -> float:
        """0.0 if allowed, else seconds until the next request would be."""
        now = time.monotonic()
        tokens, last = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1.0 - tokens) / self.rate
