"""Which replicas serve which weight version, from the fleet supervisor; failover on connect errors."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from serving.fleet_replies import FleetState, FleetStatus
from tidal.clock import now_ms

log = logging.getLogger("tidal.gateway.upstream")


class NoReplica(RuntimeError):
    """No ready replica serves the requested version."""


class Saturated(RuntimeError):
    """Every replica of the requested version has max_in_flight engine calls in flight."""


def describe_failure(e: BaseException) -> str:
    """A failed call as text fit for a log line, a health reply or an error message: the exception's type, the
    HTTP status and the URL without its query, never the request's headers. (The repr of aiohttp's
    ClientResponseError carries its RequestInfo, whose headers hold the Authorization header.)"""
    if isinstance(e, aiohttp.ClientResponseError):
        url = e.request_info.real_url.with_query(None) if e.request_info is not None else "?"
        return f"HTTP {e.status} {e.message} from {url}"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class Endpoint:
    replica: str
    url: str


@dataclass
class PoolSnapshot:
    by_served_name: dict[str, list[Endpoint]] = field(default_factory=dict)  # "tab@v2" → ready replicas
    serving_version: dict[str, int] = field(default_factory=dict)  # model → version the fleet started on
    taken_ms: int = 0
    min_first_logprob: dict[str, float] = field(default_factory=dict)  # "tab@v2" → its suggestion filter's threshold


class ReplicaPool:
    """A snapshot of ready replicas, refreshed every poll interval; failed replicas sit out briefly."""

    def __init__(
        self,
        fleet_url: str,
        admin_token: str,
        poll_s: float,
        penalty_s: float = 5.0,
        max_in_flight: int = 64,
        call_limit_s: float = 120.0,
    ):
        self.fleet_url, self.poll_s, self.penalty_s = fleet_url, poll_s, penalty_s
        # Engine calls in flight per replica: replica → {call token: monotonic start}, in start order. A call cannot
        # outlive call_limit_s (the session's total timeout), so a token a lost stream never released is dropped
        # then: in_flight() drops expired tokens from the oldest end, O(1) per request (was a scan of them all).
        self.max_in_flight, self.call_limit_s = max_in_flight, call_limit_s
        self._in_flight: dict[str, dict[int, float]] = {}
        self._tokens = itertools.count()
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self.snapshot = PoolSnapshot()
        self._down_until: dict[str, float] = {}  # replica → monotonic time it may be used again
        self._rr = itertools.count()
        self.last_error = ""

    def apply(self, fleet: FleetState) -> None:
        by_name: dict[str, list[Endpoint]] = {}
        serving: dict[str, int] = {}
        thresholds: dict[str, float] = {}
        for model, group in fleet.models.items():
            serving[model] = group.serving_version
            thresholds.update({f"{model}@v{v}": t for v, t in group.suggestion_filters.items()})
            for r in group.replicas:
                if r.state == "ready":
                    for name in r.served:
                        by_name.setdefault(name, []).append(Endpoint(r.name, r.url))
        self.snapshot = PoolSnapshot(by_name, serving, now_ms(), thresholds)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.fleet_url}/fleet", headers=self._headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            r.raise_for_status()
            self.apply(FleetStatus.model_validate(await r.json()))
        self.last_error = ""

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.refresh(session)
            except (TimeoutError, aiohttp.ClientError) as e:
                # Keep serving from the last snapshot: the supervisor being away must not stop traffic.
                self.last_error = f"fleet supervisor unreachable: {describe_failure(e)}"
                log.warning(self.last_error)
            await asyncio.sleep(self.poll_s)

    def candidates(self, served_name: str) -> list[Endpoint]:
        """Ready replicas for served_name below their in-flight cap, rotated round-robin, replicas in penalty last."""
        eps = self.snapshot.by_served_name.get(served_name, [])
        if not eps:
            raise NoReplica(f"no ready replica serves {served_name}")
        k = next(self._rr) % len(eps)
        rotated = [e for e in eps[k:] + eps[:k] if self.in_flight(e.replica) < self.max_in_flight]
        if not rotated:
            raise Saturated(
                f"all {len(eps)} replica(s) serving {served_name} have {self.max_in_flight} requests in "
                "flight (gateway.max_in_flight_per_replica); retry shortly"
            )
        now = time.monotonic()
        return [e for e in rotated if self._down_until.get(e.replica, 0) <= now] + [
            e for e in rotated if self._down_until.get(e.replica, 0) > now
        ]

    def in_flight(self, replica: str) -> int:
        calls = self._in_flight.get(replica)
        if not calls:
            return 0
        stale = time.monotonic() - self.call_limit_s
        while calls:
            token, started = next(iter(calls.items()))  # the oldest call (dicts keep insertion order)
            if started >= stale:
                break
            del calls[token]
        return len(calls)

    def acquire(self, replica: str) -> int:
        """Count an engine call to replica; returns the token release() takes."""
        token = next(self._tokens)
        self._in_flight.setdefault(replica, {})[token] = time.monotonic()
        return token

    def release(self, replica: str, token: int) -> None:
        self._in_flight.get(replica, {}).pop(token, None)

    def penalize(self, replica: str) -> None:
        self._down_until[replica] = time.monotonic() + self.penalty_s
