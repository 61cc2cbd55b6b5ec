"""Each model's demand, observed and forecast: a recent level blended with the same time of the previous day.

    recent(t)     = max(exponential average of requests/s with time constant recent_s, the latest observation)
                    (an observation: the rate over the latest forecast.rate_window_s, capacity/observe.py)
    yesterday(t)  = the busiest bucket of the previous day in [t - day, t - day + lookahead]
    forecast(t)   = max(recent, w x yesterday + (1 - w) x recent)        w = forecast.yesterday_weight

The forecast is never below the recent level, so a ramp the previous day did not have still scales serving (late
by the average's lag, which the model's headroom and its latency objective cover); the previous day's term makes
the scheduler take leases back *before* a ramp it saw yesterday. A day is cut into BUCKETS_PER_DAY buckets, each
keeping the highest rate seen in it; two days are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from capacity.settings import ForecastSettings

BUCKETS_PER_DAY = 1440  # a minute of a real day


@dataclass(frozen=True)
class Forecast:
    rps: float  # requests/s serving is sized for
    recent: float  # the recent level
    yesterday: float | None  # the previous day's busiest bucket over the lookahead, None without history

    def explain(self) -> str:
        past = "no previous day yet" if self.yesterday is None else f"{self.yesterday:.2f} the previous day"
        return f"{self.rps:.2f} req/s forecast ({self.recent:.2f} recently, {past})"


@dataclass
class _Series:
    level: float = 0.0  # the exponential average
    last: float = 0.0  # the latest observation
    t: float | None = None  # when it was made (s)
    buckets: dict[int, float] = field(default_factory=dict)  # bucket index -> highest requests/s seen in it


class DemandForecast:
    def __init__(self, cfg: ForecastSettings):
        self.cfg = cfg
        self.bucket_s = cfg.day_s / BUCKETS_PER_DAY
        self.series: dict[str, _Series] = {}

    def observe(self, model: str, t: float, rps: float) -> None:
        """The rate of requests the model got since its previous observation, at time t (s)."""
        s = self.series.setdefault(model, _Series())
        if s.t is None:
            s.level = rps
        else:
            alpha = 1.0 - math.exp(-max(0.0, t - s.t) / self.cfg.recent_s)
            s.level += alpha * (rps - s.level)
        s.last, s.t = rps, t
        b = int(t // self.bucket_s)
        s.buckets[b] = max(rps, s.buckets.get(b, 0.0))
        oldest = b - 2 * BUCKETS_PER_DAY
        for k in [k for k in s.buckets if k < oldest]:
            del s.buckets[k]

    def predict(self, model: str, t: float) -> Forecast:
        s = self.series.get(model)
        if s is None:
            return Forecast(0.0, 0.0, None)
        recent = max(s.level, s.last)
        if self.cfg.yesterday_weight == 0:  # the previous day does not count: not looked up, not shown
            return Forecast(recent, recent, None)
        lo = int((t - self.cfg.day_s) // self.bucket_s)
        hi = int((t - self.cfg.day_s + self.cfg.lookahead_s) // self.bucket_s)
        past = [s.buckets[k] for k in range(lo, hi + 1) if k in s.buckets]
        if not past:
            return Forecast(recent, recent, None)
        yesterday = max(past)
        w = self.cfg.yesterday_weight
        return Forecast(max(recent, w * yesterday + (1 - w) * recent), recent, yesterday)
