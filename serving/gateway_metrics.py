"""Gateway metrics (Prometheus, one registry per gateway instance) and the per-client rate limiter.

Completions, latency, errors, verdicts, characters and rewards are labelled by model, version and arm, so accept
rate, accepted characters and mean reward per served version are a division in PromQL (infra/monitoring/rules.yml
records them). A verdict's version and arm come from its signed request id; `unknown` for ids issued before they were
carried. Rewards are the model's reward rule (`collect.reward_rules`, the one its next dataset uses) applied to each
verdict whose suggestion length this gateway still holds; a counter only grows, so positive and negative rewards are
summed apart (gain and loss) and the mean is (gain - loss) / rewarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from data_contracts.reward_rules import BaseRewardRule
from data_contracts.rewards import RewardRule

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


SERVED = ["model", "version", "arm"]
# (model, arm, version, weight) of every routed arm, read at each scrape
RouteWeights = Callable[[], list[tuple[str, str, int, float]]]


class GatewayMetrics:
    def __init__(self, sink_metrics, rule_for: Callable[[str], BaseRewardRule] = lambda _model: RewardRule()):
        """rule_for: model → its reward rule (the app passes the settings' `collect.rule_for`)."""
        self.rule_for = rule_for
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gateway_requests", "Requests answered", ["endpoint", "code"], registry=r)
        self.completions = Counter("gateway_completions", "Completions logged", SERVED, registry=r)
        self.latency = Histogram(
            "gateway_latency_ms", "Receive to last byte, logged completions", SERVED, buckets=LATENCY_BUCKETS_MS, registry=r
        )
        self.suggested_chars = Counter(
            "gateway_suggested_chars", "Characters of the completions logged (empty when withheld)", SERVED, registry=r
        )
        self.errors = Counter("gateway_completion_errors", "Completions routed to an arm that failed (5xx)", SERVED, registry=r)
        self.verdicts = Counter(
            "gateway_verdicts", "Feedback recorded, by the verdict's version and arm", [*SERVED, "event"], registry=r
        )
        self.accepted_chars = Counter(
            "gateway_accepted_chars", "Characters users kept (whole suggestions and partial accepts)", SERVED, registry=r
        )
        self.rewarded = Counter(
            "gateway_rewarded", "Verdicts given a reward here (their suggestion's length known)", SERVED, registry=r
        )
        self.reward_gain = Counter("gateway_reward_gain", "Sum of the verdicts' positive rewards", SERVED, registry=r)
        self.reward_loss = Counter(
            "gateway_reward_loss", "Sum of the verdicts' negative rewards, as a magnitude", SERVED, registry=r
        )
        self.accepted_chars_unknown = Counter(
            "gateway_accepted_chars_unknown",
            "Accepted verdicts whose suggestion length this gateway did not hold (served elsewhere or expired)",
            ["model"],
            registry=r,
        )
        self.route_weight = Gauge(
            "gateway_route_weight", "Traffic share of each routed arm", ["model", "arm", "version"], registry=r
        )
        self.route_changes = Counter(
            "gateway_route_changes",
            "Route table changes (a canary step, a promotion, a rollback)",
            ["model", "action", "by"],
            registry=r,
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
        self.route_weights: RouteWeights = list  # the gateway binds its route table's
        # (model, version, arm) → its completions, latency and characters series: looked up once per arm, not three
        # labels() calls (a lock and a tuple each) per completion.
        self._served: dict[tuple[str, int, str], tuple] = {}

    def observe(self, model: str, version: int, arm: str, latency_ms: float, chars: int) -> None:
        series = self._served.get((model, version, arm))
        if series is None:
            served = (model, version, arm)
            series = tuple(m.labels(*served) for m in (self.completions, self.latency, self.suggested_chars))
            self.errors.labels(*served)  # a served arm's error count exists at 0: its rate reads 0, not no data
            self._served[served] = series
        completions, latency, chars_total = series
        completions.inc()
        latency.observe(latency_ms)
        chars_total.inc(chars)

    def route_changed(self, model: str, action: str, by: str) -> None:
        self.route_changes.labels(model, action, by).inc()

    def verdict(
        self, model: str, version: int | None, arm: str | None, event: str, accepted_chars: int | None, shown: int | None
    ) -> None:
        """One recorded verdict. accepted_chars: as the feedback gave it (None for a whole accept or a reject); shown:
        the suggestion's length, None when this gateway no longer holds it (then neither the characters kept nor the
        reward are known here)."""
        served = (model, version or "unknown", arm or "unknown")
        self.verdicts.labels(*served, event).inc()
        if shown is None:
            chars = accepted_chars if event == "partial" else 0 if event == "rejected" else None
        else:
            chars = {"rejected": 0, "partial": accepted_chars, "accepted": shown}[event]
            reward = self.rule_for(model).reward_of(event, accepted_chars, shown)
            self.rewarded.labels(*served).inc()
            self.reward_gain.labels(*served).inc(max(reward, 0.0))  # both series exist: their difference is defined
            self.reward_loss.labels(*served).inc(max(-reward, 0.0))
        if chars is None:
            self.accepted_chars_unknown.labels(model).inc()
        else:
            self.accepted_chars.labels(*served).inc(chars)

    def render(self) -> bytes:
        for key, value in self._sink_metrics().items():
            self._wal.labels(key).set(float(value))
        self.route_weight.clear()  # arms and versions come and go: only the current table is exported
        for model, arm, version, weight in self.route_weights():
            self.route_weight.labels(model, arm, version).set(weight)
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
