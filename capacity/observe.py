"""What the capacity scheduler sees and does, all over HTTP: each model's demand in the gateway's /metrics, its
replicas in the fleet supervisor's /fleet, and the supervisor's scale call.

    demand(model)  completions answered + those that failed, per second over the latest `rate_window_s` (at least
                   the latest two scrapes): at a few requests per second the count between two ticks is mostly noise,
                   and a noisy rate would reset every scale-down delay and revoke leases on a burst
    p99(model)     the gateway's latency histogram, differenced over the latest `window_s` (the bucket bound that
                   holds 99% of the window's requests: an upper bound, as Prometheus' histogram_quantile would give)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serving.fleet_replies import FleetStatus

DEMAND = ("gateway_completions", "gateway_completion_errors")  # counters per (model, version, arm)
LATENCY = "gateway_latency_ms"
MIN_WINDOW_REQUESTS = 20  # fewer requests in the window: no p99 (one slow request is not a broken objective)


@dataclass(frozen=True)
class Scrape:
    t: float  # when (s)
    requests: dict[str, float]  # model -> requests so far (counter)
    buckets: dict[str, dict[float, float]]  # model -> latency bucket bound (ms) -> cumulative count


def parse_gateway_metrics(t: float, text: str) -> Scrape:
    requests: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in DEMAND:
            for s in family.samples:
                if s.name.endswith("_total"):
                    requests[s.labels["model"]] = requests.get(s.labels["model"], 0.0) + s.value
        elif family.name == LATENCY:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    per = buckets.setdefault(s.labels["model"], {})
                    le = float(s.labels["le"])
                    per[le] = per.get(le, 0.0) + s.value
    return Scrape(t, requests, buckets)


def rate(prev: Scrape, cur: Scrape, model: str) -> float:
    """Requests/s between two scrapes (a gateway restart resets its counters: the rate restarts from 0)."""
    dt = cur.t - prev.t
    if dt <= 0:
        return 0.0
    now, before = cur.requests.get(model, 0.0), prev.requests.get(model, 0.0)
    return max(0.0, now - before if now >= before else now) / dt


def p99_ms(prev: Scrape, cur: Scrape, model: str) -> float | None:
    new, old = cur.buckets.get(model, {}), prev.buckets.get(model, {})
    if not new:
        return None
    deltas = sorted((le, max(0.0, n - old.get(le, 0.0))) for le, n in new.items())
    total = deltas[-1][1]  # the +Inf bucket
    if total < MIN_WINDOW_REQUESTS:
        return None
    return next(le for le, n in deltas if n >= 0.99 * total)


class Observer:
    """The gateway's and the supervisor's HTTP APIs, and a short history of gateway scrapes."""

    def __init__(self, gateway_url: str, fleet_url: str, admin_token: str, window_s: float = 60.0, rate_window_s: float = 15.0):
        self.gateway_url, self.fleet_url, self.window_s, self.rate_window_s = gateway_url, fleet_url, window_s, rate_window_s
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self.scrapes: deque[Scrape] = deque()

    def scrape(self, t: float) -> Scrape:
        r = httpx.get(f"{self.gateway_url}/metrics", timeout=5.0)
        r.raise_for_status()
        s = parse_gateway_metrics(t, r.text)
        self.scrapes.append(s)
        while len(self.scrapes) > 2 and self.scrapes[1].t <= t - self.window_s:
            self.scrapes.popleft()  # keep one scrape at least window_s old
        return s

    def demand(self, model: str) -> tuple[float | None, float | None]:
        """(requests/s over the rate window, p99 ms over the p99 window); None before two scrapes."""
        if len(self.scrapes) < 2:
            return None, None
        *older, latest = self.scrapes
        since = older[0]  # the newest scrape at least rate_window_s old, else the oldest kept
        for s in reversed(older):
            if s.t <= latest.t - self.rate_window_s:
                since = s
                break
        return rate(since, latest, model), p99_ms(self.scrapes[0], latest, model)

    def fleet(self) -> FleetStatus:
        r = httpx.get(f"{self.fleet_url}/fleet", headers=self._headers, timeout=10.0)
        r.raise_for_status()
        return FleetStatus.model_validate_json(r.content)

    def scale(self, model: str, replicas: int, timeout_s: float) -> None:
        """The supervisor answers once the new replicas are verified (or retired): it may take minutes."""
        r = httpx.post(
            f"{self.fleet_url}/fleet/{model}/scale", headers=self._headers, json={"replicas": replicas}, timeout=timeout_s
        )
        r.raise_for_status()
