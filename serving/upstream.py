"""Which replicas serve which weight version, from the fleet supervisor; failover on connect errors."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("tidal.gateway.upstream")


class NoReplica(RuntimeError):
    """No ready replica serves the requested version."""


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


class ReplicaPool:
    """A snapshot of ready replicas, refreshed every poll interval; failed replicas sit out briefly."""

    def __init__(self, fleet_url: str, admin_token: str, poll_s: float, penalty_s: float = 5.0):
        self.fleet_url, self.poll_s, self.penalty_s = fleet_url, poll_s, penalty_s
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self.snapshot = PoolSnapshot()
        self._down_until: dict[str, float] = {}  # replica → monotonic time it may be used again
        self._rr = itertools.count()
        self.last_error = ""

    def apply(self, fleet_status: dict) -> None:
        by_name: dict[str, list[Endpoint]] = {}
        serving: dict[str, int] = {}
        for model, group in fleet_status.get("models", {}).items():
            if group.get("serving_version"):
                serving[model] = group["serving_version"]
            for r in group["replicas"]:
                if r["state"] == "ready":
                    for name in r["served"]:
                        by_name.setdefault(name, []).append(Endpoint(r["name"], r["url"]))
        self.snapshot = PoolSnapshot(by_name, serving, int(time.time() * 1000))

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.fleet_url}/fleet", headers=self._headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            r.raise_for_status()
            self.apply(await r.json())
        self.last_error = ""

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.refresh(session)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # Keep serving from the last snapshot: the supervisor being away must not stop traffic.
                self.last_error = f"fleet supervisor unreachable: {describe_failure(e)}"
                log.warning(self.last_error)
            await asyncio.sleep(self.poll_s)

    def candidates(self, served_name: str) -> list[Endpoint]:
        """Ready replicas for served_name, rotated round-robin, replicas in penalty last."""
        eps = self.snapshot.by_served_name.get(served_name, [])
        if not eps:
            raise NoReplica(f"no ready replica serves {served_name}")
        k = next(self._rr) % len(eps)
        rotated = eps[k:] + eps[:k]
        now = time.monotonic()
        return [e for e in rotated if self._down_until.get(e.replica, 0) <= now] + \
               [e for e in rotated if self._down_until.get(e.replica, 0) > now]

    def penalize(self, replica: str) -> None:
        self._down_until[replica] = time.monotonic() + self.penalty_s
