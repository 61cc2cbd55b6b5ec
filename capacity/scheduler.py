"""The capacity scheduler process: `python -m capacity.scheduler` (started by `tidal up` under `capacity.mode: tidal`).

Every `capacity.tick_s`:

    scrape the gateway's /metrics  →  demand per model  →  forecast (capacity/forecast.py)
    read the supervisor's /fleet   →  replicas per model
    decide (capacity/plan.py)      →  revoke leases · reclaim overdue ones · scale each model (a thread per call)

and between ticks it answers holders: POST /leases (grant or "not yet, because ..."), POST /leases/{id}/heartbeat
(how a holder learns of a revocation), DELETE /leases/{id}; GET /capacity for `tidal status`; GET /metrics.

Serving never calls it: if it dies, the fleet keeps the replicas it has and the gateway routes as before; a holder
that cannot reach it keeps its lease and its trainer runs on (a restarted scheduler reads its book back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Field, model_validator

from capacity.api import CapacityStatus, LeaseReply, LeaseRequest, ModelCapacity
from capacity.forecast import DemandForecast
from capacity.leases import Lease, LeaseBook
from capacity.metrics import render_metrics
from capacity.observe import Observer
from capacity.plan import Decision, ModelState, Planner
from capacity.settings import CapacitySettings, capacity_problems
from serving.settings import ServingSettings
from tidal.core_settings import load_root
from tidal.model_settings import ModelSettings
from tidal.tokens import admin_authorized, admin_token

log = logging.getLogger("tidal.capacity")
SCALE_TIMEOUT_S = 900.0  # a scale call returns once its replicas are verified: a start may take minutes


class SchedulerSettings(ServingSettings):
    """What the scheduler process reads of tidal.yaml: `capacity:`, the models, and where the gateway and the
    supervisor answer (serving's sections, without loading the training plane's)."""

    capacity: CapacitySettings = Field(default_factory=CapacitySettings)

    @model_validator(mode="after")
    def _check_capacity(self) -> SchedulerSettings:
        if problems := capacity_problems(self.capacity, self.models):
            raise ValueError("settings disagree:" + "".join(f"\n    - {p}" for p in problems))
        return self


class Scheduler:
    def __init__(
        self,
        cfg: CapacitySettings,
        models: list[ModelSettings],
        observer: Observer,
        book: LeaseBook,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg, self.models, self.observer, self.book, self.clock = cfg, models, observer, book, clock
        self.forecast, self.planner = DemandForecast(cfg.forecast), Planner(cfg)
        self.lock = threading.Lock()  # the book, the decision and the free units: ticks and API calls
        self.decision: Decision | None = None
        self.decided_ms: int | None = None
        self.free = 0  # units a new lease may take until the next decision
        self.replicas: dict[str, int] = {}  # the fleet's desired replicas at the latest tick
        self.demand: dict[str, tuple[float, float | None]] = {}  # model -> (recent req/s, p99 ms)
        self.scaling: dict[str, threading.Thread] = {}
        self.counts: Counter[str] = Counter()  # event kind -> how many, for /metrics
        self.last_error = ""

    # ---- one tick -----------------------------------------------------------------------------------
    def tick(self) -> Decision | None:
        """Observe, decide, act. Returns the decision, or None when the fleet could not be read (nothing changes)."""
        now = self.clock()
        try:
            self.observer.scrape(now)
            fleet = self.observer.fleet()
        except (httpx.HTTPError, ValueError) as e:
            self.last_error = f"cannot observe the platform{_where(e)}: {e}"
            log.warning(self.last_error)
            return None
        self.last_error = ""
        states = []
        for m in self.models:
            rps, p99 = self.observer.demand(m.name)
            if rps is not None:
                self.forecast.observe(m.name, now, rps)
            status = fleet.models.get(m.name)
            replicas = status.desired_replicas if status is not None else m.replicas
            self.replicas[m.name] = replicas
            f = self.forecast.predict(m.name, now)
            self.demand[m.name] = (f.recent, p99)
            states.append(ModelState(m.name, m.capacity, m.capacity.max_replicas or m.replicas, replicas, f, p99))
        with self.lock:
            now_ms = int(now * 1000)
            for lease, why in self.book.overdue(now_ms):
                self.book.reclaim(lease, now_ms, why)
                self.counts["reclaim"] += 1
                log.warning("lease %s of %s reclaimed: %s", lease.id, lease.holder, why)
            d = self.planner.decide(now, states, self.book.held())
            for lease, why in d.revoke:
                self.book.revoke(lease, now_ms, why)
                self.counts["revoke"] += 1
                log.info("lease %s of %s revoked: %s", lease.id, lease.holder, why)
            self.decision, self.decided_ms, self.free = d, now_ms, d.free_for_leases
        for m in self.models:
            if d.replicas[m.name] != self.replicas[m.name]:
                self._scale(m.name, self.replicas[m.name], d.replicas[m.name], d.reasons[m.name], now_ms)
        return d

    def _scale(self, model: str, have: int, want: int, reason: str, now_ms: int) -> None:
        running = self.scaling.get(model)
        if running is not None and running.is_alive():
            return  # one scale call per model at a time; the next tick sees where it got to
        with self.lock:
            self.book.note(
                now_ms, "scale", f"{model}: {have} -> {want} replica(s): {reason}", units=want * self.cfg.units_per_replica
            )
            self.counts["scale"] += 1
        log.info("%s: %d -> %d replica(s): %s", model, have, want, reason)

        def call() -> None:
            try:
                self.observer.scale(model, want, SCALE_TIMEOUT_S)
                with self.lock:
                    self.replicas[model] = want
            except httpx.HTTPError as e:  # the next tick decides again from what the fleet then holds
                log.warning("%s: scaling to %d failed: %s", model, want, e)

        self.scaling[model] = threading.Thread(target=call, name=f"scale-{model}", daemon=True)
        self.scaling[model].start()

    # ---- holders --------------------------------------------------------------------------------------
    def request(self, req: LeaseRequest) -> LeaseReply:
        retry = self.cfg.tick_s
        with self.lock:
            held = self.book.held_by(req.holder)
            if held is not None and held.state == "active":  # asked again (a retried flow): the same lease
                return LeaseReply(granted=True, lease=held, reason="already held by this holder")
            if held is not None:
                return LeaseReply(
                    granted=False,
                    reason=f"this holder's lease {held.id} is being revoked: it must come back first",
                    retry_after_s=retry,
                )
            if self.decision is None:
                return LeaseReply(
                    granted=False, reason="no decision yet: the scheduler has not observed demand", retry_after_s=retry
                )
            want = min(x for x in (req.max_units, self.cfg.lease.max_units, self.free) if x is not None)
            least = max(req.min_units, self.cfg.lease.min_units)
            if want < least:
                needs = ", ".join(f"{k} {v}" for k, v in self.decision.needed.items())
                return LeaseReply(
                    granted=False,
                    reason=(
                        f"{self.free} unit(s) free, {least} needed: serving needs {needs} replica(s), "
                        f"{self.book.lent_units()} unit(s) already lent"
                    ),
                    retry_after_s=retry,
                )
            lease = self.book.grant(req.holder, want, int(self.clock() * 1000), f"{self.free} unit(s) free beside serving")
            self.free -= want
            self.counts["grant"] += 1
        log.info("lease %s of %d unit(s) granted to %s", lease.id, lease.units, lease.holder)
        return LeaseReply(granted=True, lease=lease, reason=f"granted {want} unit(s)")

    def heartbeat(self, lease_id: str) -> Lease:
        with self.lock:
            return self.book.heartbeat(self._get(lease_id), int(self.clock() * 1000))

    def release(self, lease_id: str) -> Lease:
        with self.lock:
            lease = self._get(lease_id)
            if lease.holds_units:
                self.free += lease.units if lease.state == "active" else 0
                self.counts["release"] += 1
            return self.book.release(lease, int(self.clock() * 1000))

    def _get(self, lease_id: str) -> Lease:
        lease = self.book.get(lease_id)
        if lease is None:
            raise HTTPException(404, f"no lease {lease_id!r}: never granted, or ended long ago")
        return lease

    def status(self) -> CapacityStatus:
        with self.lock:
            d, held = self.decision, self.book.held()
            models = {}
            for m in self.models:
                recent, p99 = self.demand.get(m.name, (0.0, None))
                models[m.name] = ModelCapacity(
                    replicas=self.replicas.get(m.name, m.replicas),
                    needed=d.needed[m.name] if d else m.replicas,
                    reason=d.reasons[m.name] if d else "no decision yet",
                    forecast_rps=self.forecast.predict(m.name, self.clock()).rps,
                    recent_rps=recent,
                    p99_ms=p99,
                )
            return CapacityStatus(
                mode=self.cfg.mode,
                unit=self.cfg.unit,
                total_units=self.cfg.total_units,
                usable_units=self.cfg.usable_units,
                serving_units=sum(x.replicas for x in models.values()) * self.cfg.units_per_replica,
                lent_units=sum(x.units for x in held),
                decided_at_ms=self.decided_ms,
                last_error=self.last_error,
                models=models,
                leases=held,
                events=list(self.book.events)[-50:],
            )

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001  one bad tick is logged; the next one decides afresh
                log.exception("capacity tick failed")
            stop.wait(self.cfg.tick_s)


def _where(e: Exception) -> str:
    """' (GET http://...)' of a failed HTTP call: which of the gateway and the supervisor did not answer."""
    try:
        return f" ({e.request.method} {e.request.url})" if isinstance(e, httpx.HTTPError) else ""
    except RuntimeError:  # an error raised before its request existed
        return ""


def build_app(scheduler: Scheduler, admin_token: str) -> FastAPI:
    app = FastAPI(title="Tidal capacity scheduler", version="1")

    def admin(authorization: str = Header("")) -> None:
        if not admin_authorized(authorization, admin_token):
            raise HTTPException(401, "missing or wrong admin token (Authorization: Bearer <admin token>)")

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    def metrics() -> Response:  # units, replicas and event counts only: no holder names beyond run keys, no token
        return Response(render_metrics(scheduler.status(), scheduler.counts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/capacity", dependencies=[Depends(admin)])
    def capacity() -> CapacityStatus:
        return scheduler.status()

    @app.post("/leases", dependencies=[Depends(admin)])
    def request_lease(body: LeaseRequest) -> LeaseReply:
        return scheduler.request(body)

    @app.post("/leases/{lease_id}/heartbeat", dependencies=[Depends(admin)])
    def heartbeat(lease_id: str) -> Lease:
        return scheduler.heartbeat(lease_id)

    @app.delete("/leases/{lease_id}", dependencies=[Depends(admin)])
    def release(lease_id: str) -> Lease:
        return scheduler.release(lease_id)

    return app


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    s = load_root(SchedulerSettings)
    token = admin_token(s)
    observer = Observer(
        f"http://{s.gateway.host}:{s.gateway.port}",
        f"http://{s.fleet.host}:{s.fleet.admin_port}",
        token,
        rate_window_s=s.capacity.forecast.rate_window_s,
    )
    book = LeaseBook(s.data_path / "capacity" / "leases.json", s.capacity.lease.grace_s, s.capacity.lease.heartbeat_s)
    scheduler = Scheduler(s.capacity, s.models, observer, book)
    stop = threading.Event()
    threading.Thread(target=scheduler.run, args=(stop,), name="capacity-ticks", daemon=True).start()
    try:
        uvicorn.run(build_app(scheduler, token), host=s.capacity.host, port=s.capacity.port, log_level="warning")
    finally:
        stop.set()


if __name__ == "__main__":
    main()
