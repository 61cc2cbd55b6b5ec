"""One decision of the capacity scheduler: how many replicas each model gets, then which leases go.

    needed(model)  = clamp(ceil(forecast x (1 + headroom) / rps_per_replica), min_replicas, max_replicas)
                     raised by one over the replicas running when the latest p99 broke the latency objective
    serving units  = sum of needed x units_per_replica  (never above the usable pool; min_replicas always fit,
                     checked at start-up)
    lendable       = usable - serving units
    revoke         the newest active leases until the active ones fit in `lendable`
    scale          down at once when a model has needed fewer replicas for scale_down_after_s; up as far as the
                   units not lent allow (a revoking lease's units come back when it is released or reclaimed)

Pure apart from the per-model time since a model last needed its replicas (the scale-down delay), so that a
whole simulated day can be decided in a test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from capacity.forecast import Forecast
from capacity.leases import Lease
from capacity.settings import CapacitySettings
from tidal.model_settings import ServingCapacity


@dataclass(frozen=True)
class ModelState:
    """What the scheduler knows of one model at a tick."""

    name: str
    bounds: ServingCapacity
    max_replicas: int  # bounds.max_replicas, or the model's configured replicas
    replicas: int  # the fleet's replicas now (its desired count)
    forecast: Forecast
    p99_ms: float | None  # the gateway's p99 over the latest window, None with too few requests


@dataclass(frozen=True)
class Decision:
    replicas: dict[str, int]  # model -> replicas to run now
    needed: dict[str, int]  # model -> replicas its demand asks for (replicas may lag: units still lent)
    reasons: dict[str, str]  # model -> why that many
    lendable: int  # units training may hold once serving has what it needs
    revoke: list[tuple[Lease, str]]  # active leases to revoke now, with the reason
    free_for_leases: int  # units a new lease may take now


@dataclass
class Planner:
    cfg: CapacitySettings
    needed_less_since: dict[str, float] = field(default_factory=dict)  # model -> since when it needs fewer replicas

    def needed(self, m: ModelState) -> tuple[int, str]:
        b = m.bounds
        n = math.ceil(m.forecast.rps * (1 + b.headroom) / b.rps_per_replica - 1e-9)
        why = f"{m.forecast.explain()} x {1 + b.headroom:g} headroom / {b.rps_per_replica:g} req/s per replica"
        if m.p99_ms is not None and m.p99_ms > b.latency_objective_ms and n <= m.replicas:
            n, why = m.replicas + 1, f"p99 {m.p99_ms:.0f} ms over the {b.latency_objective_ms:.0f} ms objective"
        if n < b.min_replicas:
            n, why = b.min_replicas, f"{why}; min_replicas {b.min_replicas}"
        if n > m.max_replicas:
            n, why = m.max_replicas, f"{why}; capped at max_replicas {m.max_replicas}"
        return n, why

    def decide(self, now_s: float, models: list[ModelState], held: list[Lease]) -> Decision:
        upr, usable = self.cfg.units_per_replica, self.cfg.usable_units
        needed, reasons = {}, {}
        for m in models:
            needed[m.name], reasons[m.name] = self.needed(m)
        # serving never above the pool: trim the models furthest above their minimum, one replica at a time
        while sum(needed.values()) * upr > usable:
            over = max(models, key=lambda m: needed[m.name] - m.bounds.min_replicas)
            if needed[over.name] <= over.bounds.min_replicas:
                break  # min_replicas alone exceed the pool: refused at start-up, so not reached
            needed[over.name] -= 1
            reasons[over.name] += f"; trimmed to {needed[over.name]}: the pool has {usable} units"
        lendable = usable - sum(needed.values()) * upr

        revoke, active = [], [x for x in held if x.state == "active"]
        keep = sum(x.units for x in active)
        why = "serving needs " + ", ".join(f"{k} {v} replica(s) ({reasons[k]})" for k, v in needed.items())
        for lease in sorted(active, key=lambda x: x.granted_ms, reverse=True):  # the newest go first
            if keep <= lendable:
                break
            revoke.append((lease, f"{why}; {lendable} unit(s) left to lend"))
            keep -= lease.units

        # scale: down only after the delay; up into the units not lent (revoking leases still hold theirs)
        room = usable - sum(x.units for x in held)  # a lease revoked now still holds its units until it is back
        replicas = {}
        for m in models:
            want = needed[m.name]
            if want < m.replicas:
                since = self.needed_less_since.setdefault(m.name, now_s)
                replicas[m.name] = want if now_s - since >= self.cfg.scale_down_after_s else m.replicas
            else:
                self.needed_less_since.pop(m.name, None)
                replicas[m.name] = m.replicas
            room -= replicas[m.name] * upr
        for m in sorted(models, key=lambda m: needed[m.name] - replicas[m.name], reverse=True):
            while replicas[m.name] < needed[m.name] and room >= upr:
                replicas[m.name] += 1
                room -= upr
        free = max(0, min(room, lendable - keep))
        return Decision(replicas, needed, reasons, lendable, revoke, free)
