"""A lease holder's side of the capacity scheduler (the train task): ask until granted, renew while the trainer
runs, learn of a revocation, give the units back.

    lease = client.acquire(LeaseRequest(holder=run_key, min_units=n, max_units=n))
    with LeaseWatch(client, lease, stop_event, heartbeat_s):   # sets stop_event once revoked (or ended)
        run the trainer until it finishes or stops
    client.release(lease.id)

A scheduler that cannot be reached changes nothing for a running trainer: the watch keeps trying and the trainer
keeps its lease (serving never depends on the scheduler, and neither does a run already granted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

from capacity.api import LeaseReply, LeaseRequest
from capacity.leases import Lease

log = logging.getLogger("tidal.capacity")


class LeaseClient:
    def __init__(self, url: str, token: str, timeout_s: float = 10.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._headers = {"Authorization": f"Bearer {token}"}

    def ask(self, req: LeaseRequest) -> LeaseReply:
        r = httpx.post(f"{self.url}/leases", json=req.model_dump(), headers=self._headers, timeout=self.timeout_s)
        r.raise_for_status()
        return LeaseReply.model_validate_json(r.content)

    def acquire(
        self, req: LeaseRequest, say: Callable[[str], None] = log.info, sleep: Callable[[float], None] = time.sleep
    ) -> Lease:
        """Ask until granted, saying why not whenever the reason changes (an unreachable scheduler included)."""
        said = None
        while True:
            try:
                reply = self.ask(req)
            except httpx.HTTPError as e:
                reply = LeaseReply(granted=False, reason=f"capacity scheduler unreachable at {self.url}: {e}", retry_after_s=5.0)
            if reply.granted and reply.lease is not None:
                say(f"{req.holder}: lease {reply.lease.id} of {reply.lease.units} unit(s) ({reply.reason})")
                return reply.lease
            if reply.reason != said:
                say(f"{req.holder}: waiting for a lease: {reply.reason}")
                said = reply.reason
            sleep(max(reply.retry_after_s, 0.5))

    def heartbeat(self, lease_id: str) -> Lease | None:
        """The lease as the scheduler holds it now; None once it is unknown to it (ended long ago)."""
        r = httpx.post(f"{self.url}/leases/{lease_id}/heartbeat", headers=self._headers, timeout=self.timeout_s)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return Lease.model_validate_json(r.content)

    def release(self, lease_id: str) -> None:
        """Give the units back; a scheduler that cannot be reached reclaims them when the heartbeats stop."""
        try:
            httpx.delete(f"{self.url}/leases/{lease_id}", headers=self._headers, timeout=self.timeout_s).raise_for_status()
        except httpx.HTTPError as e:
            log.warning("lease %s not released (%s): the scheduler reclaims it once its heartbeats stop", lease_id, e)


class LeaseWatch:
    """`with LeaseWatch(client, lease, stop, heartbeat_s):` renews the lease every heartbeat_s in a thread and sets
    `stop` once the scheduler says it is revoked, reclaimed or unknown. `revoked` says why, once it is."""

    def __init__(self, client: LeaseClient, lease: Lease, stop: threading.Event, heartbeat_s: float):
        self.client, self.lease, self.stop, self.heartbeat_s = client, lease, stop, heartbeat_s
        self.revoked: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.id}", daemon=True)

    def __enter__(self) -> LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            try:
                now = self.client.heartbeat(self.lease.id)
            except httpx.HTTPError as e:  # keep the lease: the scheduler reads its book back when it returns
                log.warning("lease %s: heartbeat failed (%s); the trainer keeps running", self.lease.id, e)
                continue
            if now is None or now.state != "active":
                self.revoked = now.reason if now is not None else "the scheduler no longer knows the lease"
                log.info("lease %s: %s; stopping the trainer", self.lease.id, self.revoked)
                self.stop.set()
                return
