"""The lease book: units of the pool lent to training, and every change to them as an event with its reason.

    requested ──grant──▶ active ──revoke──▶ revoking ──release──▶ released
                           │                   └──── grace_s passed ───▶ reclaimed
                           └── no heartbeat for 4 periods ─────────────▶ reclaimed (its holder died)

A lease is granted whole or not at all. Units in a revoking lease still count as lent until it is released or
reclaimed: serving scales up into them only then, so a replica never shares a core with a trainer still writing its
checkpoint. The book is saved (a JSON file, replaced whole) after every change, so a restarted scheduler knows what
it lent; serving never reads it.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

LeaseState = Literal["active", "revoking", "released", "reclaimed"]
EventKind = Literal["grant", "revoke", "release", "reclaim", "scale"]
MISSED_HEARTBEATS = 4  # periods without a heartbeat before an active lease is reclaimed
KEPT_EVENTS = 500  # the book keeps the latest events (every event is also counted in /metrics)
KEPT_ENDED = 100  # ended leases kept in memory, so that a holder asking after one learns how it ended


class Lease(BaseModel):
    """One grant of units to a training run (the scheduler's API returns it; the holder polls it)."""

    id: str = Field(description="Opaque lease id.")
    holder: str = Field(description="Who holds it: the training run's key.")
    units: int = Field(ge=1, description="Units of the pool lent (capacity.unit: cores, GPUs or nodes).")
    state: LeaseState = Field(description="active: use the units; revoking: stop by `deadline_ms`; released/reclaimed: over.")
    granted_ms: int = Field(description="When it was granted (Unix ms).")
    heartbeat_ms: int = Field(description="The holder's latest renewal (Unix ms).")
    revoked_ms: int | None = Field(None, description="When it was revoked (Unix ms), if it was.")
    deadline_ms: int | None = Field(None, description="Revoked: the units must be back by then (revoked_ms + grace).")
    reason: str = Field("", description="Why it was revoked or reclaimed.")

    @property
    def holds_units(self) -> bool:
        return self.state in ("active", "revoking")


class LeaseEvent(BaseModel):
    """A grant, revocation, release, reclaim or a serving scale decision, with its reason."""

    time_ms: int
    kind: EventKind
    lease_id: str | None = None
    holder: str | None = None
    units: int = 0
    reason: str


class BookFile(BaseModel):
    """The book's stored form."""

    leases: list[Lease]
    events: list[LeaseEvent]


class LeaseBook:
    """The leases and their events; `path` None keeps them in memory only (tests, a dry run)."""

    def __init__(self, path: Path | None, grace_s: float, heartbeat_s: float, now_ms: int | None = None):
        """`now_ms`: when a stored book is read back (default: now). Its active leases count their heartbeats from
        then: a holder could not reach a scheduler that was down, so a restart after more than four periods must not
        reclaim every lease before its holder's next heartbeat. A revoked lease keeps its deadline (serving's)."""
        self.path, self.grace_ms, self.heartbeat_ms = path, int(grace_s * 1000), int(heartbeat_s * 1000)
        self.leases: dict[str, Lease] = {}
        self.ended: dict[str, Lease] = {}
        self.events: deque[LeaseEvent] = deque(maxlen=KEPT_EVENTS)
        if path is not None and path.exists():
            stored = BookFile.model_validate_json(path.read_text())
            loaded_ms = int(time.time() * 1000) if now_ms is None else now_ms
            self.leases = {x.id: x for x in stored.leases if x.holds_units}
            for x in self.leases.values():
                if x.state == "active":
                    x.heartbeat_ms = max(x.heartbeat_ms, loaded_ms)
            self.events.extend(stored.events)

    # ---- what is lent ----------------------------------------------------------------------------------
    def held(self) -> list[Lease]:
        """Leases whose units are not back: active and revoking, oldest first."""
        return sorted((x for x in self.leases.values() if x.holds_units), key=lambda x: x.granted_ms)

    def lent_units(self) -> int:
        return sum(x.units for x in self.held())

    def active_units(self) -> int:
        return sum(x.units for x in self.held() if x.state == "active")

    def get(self, lease_id: str) -> Lease | None:
        """A held lease, or one that ended lately (released, reclaimed), or None."""
        return self.leases.get(lease_id) or self.ended.get(lease_id)

    def held_by(self, holder: str) -> Lease | None:
        return next((x for x in self.held() if x.holder == holder), None)

    # ---- changes ---------------------------------------------------------------------------------------
    def grant(self, holder: str, units: int, now_ms: int, reason: str) -> Lease:
        lease = Lease(
            id="lease-" + secrets.token_hex(6),
            holder=holder,
            units=units,
            state="active",
            granted_ms=now_ms,
            heartbeat_ms=now_ms,
        )
        self.leases[lease.id] = lease
        self._event(now_ms, "grant", lease, reason)
        return lease

    def revoke(self, lease: Lease, now_ms: int, reason: str) -> Lease:
        """active → revoking, due back within the grace period (revoking one already revoking changes nothing)."""
        if lease.state != "active":
            return lease
        lease.state, lease.revoked_ms, lease.deadline_ms, lease.reason = "revoking", now_ms, now_ms + self.grace_ms, reason
        self._event(now_ms, "revoke", lease, reason)
        return lease

    def heartbeat(self, lease: Lease, now_ms: int) -> Lease:
        if lease.holds_units:
            lease.heartbeat_ms = now_ms
            self._save()
        return lease

    def release(self, lease: Lease, now_ms: int) -> Lease:
        """The holder gave the units back (its run finished, failed or stopped on revocation)."""
        if lease.holds_units:
            lease.state = "released"
            reason = "returned after its revocation" if lease.revoked_ms is not None else "its run ended"
            self._end(lease)
            self._event(now_ms, "release", lease, reason)
        return lease

    def overdue(self, now_ms: int) -> list[tuple[Lease, str]]:
        """Leases to reclaim now, with why: revoked past their deadline, or silent for MISSED_HEARTBEATS periods."""
        out = []
        for x in self.held():
            if x.state == "revoking" and x.deadline_ms is not None and now_ms >= x.deadline_ms:
                out.append((x, f"not returned within the {self.grace_ms / 1000:g} s grace period after its revocation"))
            elif x.state == "active" and now_ms - x.heartbeat_ms > MISSED_HEARTBEATS * self.heartbeat_ms:
                out.append((x, f"no heartbeat for {(now_ms - x.heartbeat_ms) / 1000:.0f} s: its holder is gone"))
        return out

    def reclaim(self, lease: Lease, now_ms: int, reason: str) -> Lease:
        lease.state, lease.reason = "reclaimed", reason
        self._end(lease)
        self._event(now_ms, "reclaim", lease, reason)
        return lease

    def _end(self, lease: Lease) -> None:
        del self.leases[lease.id]
        self.ended[lease.id] = lease
        while len(self.ended) > KEPT_ENDED:
            del self.ended[next(iter(self.ended))]

    def note(self, now_ms: int, kind: EventKind, reason: str, units: int = 0) -> None:
        """An event of the scheduler's own (a scale decision) in the same record as the leases'."""
        self.events.append(LeaseEvent(time_ms=now_ms, kind=kind, units=units, reason=reason))
        self._save()

    def _event(self, now_ms: int, kind: EventKind, lease: Lease, reason: str) -> None:
        self.events.append(
            LeaseEvent(time_ms=now_ms, kind=kind, lease_id=lease.id, holder=lease.holder, units=lease.units, reason=reason)
        )
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(BookFile(leases=list(self.leases.values()), events=list(self.events)).model_dump_json())
        os.replace(tmp, self.path)  # whole or not at all: a crash mid-write leaves the previous book
