"""A day of traffic, compressed: the simulated users' request rate follows a daily curve, so that the demo and the
benchmarks show the tide the capacity scheduler lends and takes back (capacity/).

    rate(t) = trough + (peak - trough) x (1 + cos(2 pi (hour(t) - peak_hour) / 24)) / 2
    hour(t) = 24 x (t mod day_s) / day_s                 trough = peak_rps / peak_to_trough

Arrivals are spaced by integrating the rate (one request each time the integral passes a whole number), so a run is
reproducible: the same curve gives the same send times.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pydantic import Field

from tidal.section import Section


class DailyCurve(Section):
    day_s: float = Field(600.0, gt=0, description="How long a simulated day lasts (600: a day in ten minutes).")
    peak_rps: float = Field(4.0, gt=0, description="Requests per second at the busiest moment of the day.")
    peak_to_trough: float = Field(
        4.0, ge=1, description="How many times busier the peak is than the quietest moment (1: a flat day)."
    )
    peak_hour: float = Field(14.0, ge=0, lt=24, description="The simulated hour of the peak; the trough is 12 hours away.")
    start_hour: float = Field(0.0, ge=0, lt=24, description="The simulated hour at which a run starts.")

    @property
    def trough_rps(self) -> float:
        return self.peak_rps / self.peak_to_trough

    def hour(self, t_s: float) -> float:
        """The simulated hour t_s seconds into the run."""
        return (self.start_hour + 24.0 * t_s / self.day_s) % 24.0

    def rate(self, t_s: float) -> float:
        """Requests/s t_s seconds into the run."""
        phase = 2 * math.pi * (self.hour(t_s) - self.peak_hour) / 24.0
        return self.trough_rps + (self.peak_rps - self.trough_rps) * (1 + math.cos(phase)) / 2

    def arrivals(self, step_s: float = 0.05) -> Iterator[float]:
        """Send times (seconds into the run), endless: one each time the rate's integral from 0 crosses a whole
        number (midpoint rule, step_s apart; linear within a step)."""
        t, area = 0.0, 0.0
        while True:
            before, area = area, area + self.rate(t + step_s / 2) * step_s
            for k in range(math.floor(before) + 1, math.floor(area) + 1):
                yield t + (k - before) / (area - before) * step_s
            t += step_s
