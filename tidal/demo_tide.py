"""The demo on the tide (`demo.capacity.mode: tidal`): the settings that put its cycles on the capacity scheduler,
the timeline of demand, serving replicas and training leases sampled while the users send, and its plot.

    users on `demo.day` → gateway → capacity scheduler (observes the rate; sizes the cycled model between
    `demo.serving`'s bounds; lends the rest of the pool) → each cycle's trainer waits for a lease, trains on it,
    checkpoints and stops when it is revoked at a ramp, and resumes on the next lease (tasks/train.py)

The timeline is the scheduler's own view (GET /capacity) every `period_s`, beside the rate the users' curve asked
for at that moment: what the demo's report plots.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field

from capacity.leases import LeaseEvent
from capacity.settings import capacity_problems
from sim.daily_curve import DailyCurve
from tidal.model_settings import ModelSettings, ServingCapacity
from tidal.section import SettingsError
from tidal.settings import TidalSettings


def tidal_updates(settings: TidalSettings, models: list[ModelSettings], model: str) -> dict:
    """The parts of the demo's profile the tide changes: `capacity` (demo.capacity on capacity's host and port, the
    forecast's day the users'), the models' bounds (the cycled one `demo.serving`'s, the others held at their
    replicas) and the users' day. Checked as `tidal up` checks capacity settings, each problem with its fix."""
    demo = settings.demo
    curve = demo.users.daily or demo.day
    cap = demo.capacity.model_copy(
        update={
            "host": settings.capacity.host,
            "port": settings.capacity.port,
            "forecast": demo.capacity.forecast.model_copy(update={"day_s": curve.day_s}),
        }
    )
    bounded = []
    for m in models:
        if m.name == model:
            lo, hi = demo.serving.min_replicas, demo.serving.max_replicas or max(m.replicas, 1)
            bounded.append(m.model_copy(update={"capacity": demo.serving, "replicas": min(max(m.replicas, lo), hi)}))
        else:  # not the demo's: it keeps what it runs
            held = ServingCapacity(min_replicas=m.replicas, max_replicas=max(m.replicas, 1))
            bounded.append(m.model_copy(update={"capacity": held}))
    if problems := capacity_problems(cap, bounded):
        raise SettingsError(
            "the demo's tide (demo.capacity.mode tidal) does not fit:"
            + "".join(f"\n    - {p}" for p in problems)
            + "\n  (the demo's bounds are demo.serving and demo.capacity; or set demo.capacity.mode: static)"
        )
    users = demo.users.model_copy(update={"daily": curve})
    return {"capacity": cap, "models": bounded, "demo": demo.model_copy(update={"users": users})}


class TideSample(BaseModel):
    """One look at the scheduler during the demo (tide.json, the report's plot)."""

    t_s: float = Field(description="Seconds since the users started.")
    hour: float = Field(description="The simulated hour of the users' day then.")
    scheduled_rps: float = Field(description="Requests/s the users' curve asked for then.")
    observed_rps: float | None = Field(description="The cycled model's recent rate as the scheduler saw it.")
    forecast_rps: float | None = Field(description="What the scheduler sized serving for.")
    replicas: int | None = Field(description="Replicas of the cycled model (the fleet's desired count).")
    lent_units: int | None = Field(description="Units held by training leases (active and revoking).")
    p99_ms: float | None = Field(None, description="The cycled model's p99 over the gateway's last minute, if known.")
    events: list[LeaseEvent] = Field(
        default_factory=list, description="The scheduler's grants, revocations, releases and reclaims since the last look."
    )


class TideWatch(threading.Thread):
    """Samples the capacity scheduler every `period_s` until `stop` is set; a look it misses is left out (the
    scheduler being down never touches serving or the demo)."""

    def __init__(self, platform, model: str, curve: DailyCurve, period_s: float = 2.0):
        super().__init__(daemon=True, name="tide-watch")
        self.platform, self.model, self.curve, self.period_s = platform, model, curve, period_s
        self.samples: list[TideSample] = []
        self.stop = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        seen_ms = int(time.time() * 1000)
        while not self.stop.wait(self.period_s):
            t = time.monotonic() - self.started_at
            status = self.platform.capacity_status()
            m = status.models.get(self.model) if status else None
            fresh = [e for e in status.events if e.time_ms > seen_ms and e.kind != "scale"] if status else []
            seen_ms = max([seen_ms, *(e.time_ms for e in fresh)])
            self.samples.append(
                TideSample(
                    t_s=round(t, 2),
                    hour=round(self.curve.hour(t), 3),
                    scheduled_rps=round(self.curve.rate(t), 3),
                    observed_rps=m.recent_rps if m else None,
                    forecast_rps=m.forecast_rps if m else None,
                    replicas=m.replicas if m else None,
                    lent_units=status.lent_units if status else None,
                    p99_ms=m.p99_ms if m else None,
                    events=fresh,
                )
            )


def plot_tide(samples: list[TideSample], model: str, objective_ms: float, path: Path) -> Path:
    """Demand (the users' curve, the observed and forecast rates) at the top, the cycled model's replicas and the
    units lent to training in the middle, its p99 against the latency objective at the bottom, on one time axis;
    revocations marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    t = [s.t_s / 60 for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True, height_ratios=(3, 2, 2))
    top.plot(t, [s.scheduled_rps for s in samples], "--", color="grey", label="users' day (req/s asked)")
    top.plot(t, [s.observed_rps for s in samples], label="observed req/s")
    top.plot(t, [s.forecast_rps for s in samples], ":", linewidth=2, label="forecast req/s (what serving is sized for)")
    top.set_ylabel("requests/s")
    top.legend(fontsize="small", loc="upper left")
    middle.step(t, [s.replicas for s in samples], where="post", label=f"{model} replicas")
    middle.step(t, [s.lent_units for s in samples], where="post", label="units lent to training")
    middle.set_ylabel("units")
    middle.legend(fontsize="small", loc="upper left")
    bottom.plot(t, [s.p99_ms for s in samples], label="p99 over the last minute (gateway)")
    bottom.axhline(objective_ms, color="black", linestyle="--", linewidth=1, label="latency objective")
    bottom.set_ylabel("ms")
    bottom.legend(fontsize="small", loc="upper left")
    for s in samples:
        if any(e.kind == "revoke" for e in s.events):
            for ax in (top, middle, bottom):
                ax.axvline(s.t_s / 60, color="red", alpha=0.4, linewidth=1)
    bottom.set_xlabel("minutes (red: a lease revoked)")
    top.set_title(f"{model}: demand, serving and training over the demo's simulated days")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class TideSummary(BaseModel):
    """The demo's tide in figures (tide.json beside its samples; `tide/*` metrics of the demo's MLflow run)."""

    minutes: float = Field(description="How long the scheduler was watched.")
    lent_share: float = Field(description="Share of the looks at which training held units.")
    grants: int = Field(description="Leases granted.")
    revocations: int = Field(description="Leases revoked (each a preempted trainer, which resumed on a later lease).")
    replicas_min: int | None = Field(description="The fewest replicas the cycled model had.")
    replicas_max: int | None = Field(description="The most.")
    p99_over_objective_share: float | None = Field(
        description="Share of the looks with a known p99 at which it was over the model's latency objective."
    )

    def describe(self) -> str:
        return (
            f"tide: {self.grants} lease(s) granted, {self.revocations} revoked, training held units in "
            f"{self.lent_share:.0%} of {self.minutes:.1f} min; replicas {self.replicas_min}-{self.replicas_max}; p99 over "
            + (
                "its objective: unknown"
                if self.p99_over_objective_share is None
                else f"its objective in {self.p99_over_objective_share:.0%} of the looks"
            )
        )


def summarize_tide(samples: list[TideSample], objective_ms: float) -> TideSummary:
    events = [e for s in samples for e in s.events]
    replicas = [s.replicas for s in samples if s.replicas is not None]
    looked = [s for s in samples if s.lent_units is not None]
    timed = [s.p99_ms for s in samples if s.p99_ms is not None]
    return TideSummary(
        minutes=round(samples[-1].t_s / 60, 2) if samples else 0.0,
        lent_share=round(sum(s.lent_units > 0 for s in looked) / len(looked), 3) if looked else 0.0,
        grants=sum(e.kind == "grant" for e in events),
        revocations=sum(e.kind == "revoke" for e in events),
        replicas_min=min(replicas, default=None),
        replicas_max=max(replicas, default=None),
        p99_over_objective_share=round(sum(p > objective_ms for p in timed) / len(timed), 3) if timed else None,
    )
