"""Paired comparisons of two versions on the same held-out requests.

Every version replays the same sites, users and sampling seeds (sim/evaluate.py), so the difference between
two versions is best measured request by request: the noise the requests share (a hard site, a picky user)
cancels, and the interval is much narrower than two independent intervals side by side.

Intervals come from a paired bootstrap: resample request indices with replacement, the same indices for both
versions, and recompute each metric on the resample; the 2.5% and 97.5% percentiles bound it. That covers the
accept rate too, a ratio of two sums (accepts over suggestions shown) whose denominator differs between the
versions, where a plain paired t-interval does not apply.

Ratios (b / a) are given only for the metrics that cannot be negative; reward per request can be, and a ratio
of negative means flips its meaning, so it gets a difference only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.evaluate import Estimate, Outcomes

POSITIVE_METRICS = ("suggestion_rate", "accept_rate", "accepted_chars_per_request")
METRICS = ("suggestion_rate", "accept_rate", "reward_per_request", "accepted_chars_per_request")


def _metrics(o: Outcomes, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Each metric for every resample: idx (R, N) request indices → (R,) values."""
    shown = o.shown[idx].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        accept = o.accepted[idx].sum(1) / shown  # NaN on a resample with no suggestion shown
    return {
        "suggestion_rate": o.shown[idx].mean(1),
        "accept_rate": accept,
        "reward_per_request": o.reward[idx].mean(1),
        "accepted_chars_per_request": o.kept[idx].mean(1),
    }


@dataclass(frozen=True)
class Comparison:
    """b against a on one metric: the difference b − a and, for a metric that cannot be negative, the ratio b / a,
    each with its paired 95% interval (ratio None where it does not apply or a's value is 0)."""

    metric: str
    a: float
    b: float
    delta: Estimate
    ratio: Estimate | None

    @property
    def significant(self) -> bool:
        """The difference's interval excludes 0."""
        return self.delta.low > 0 or self.delta.high < 0

    def describe(self) -> str:
        if self.ratio is not None:
            return f"{self.metric} ×{self.ratio.mean:.2f} [{self.ratio.low:.2f}, {self.ratio.high:.2f}]"
        return f"{self.metric} {self.delta.mean:+.4f} [{self.delta.low:+.4f}, {self.delta.high:+.4f}]"


def compare(a: Outcomes, b: Outcomes, resamples: int = 2000, seed: int = 0) -> dict[str, Comparison]:
    """b − a (and b / a) on every metric, over the same requests, with paired bootstrap intervals."""
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"paired comparison needs the same non-empty requests on both sides; got {len(a)} and {len(b)}")
    n = len(a)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # (R, N), shared by both versions
    whole = np.arange(n)[None, :]
    ma, mb, pa, pb = _metrics(a, idx), _metrics(b, idx), _metrics(a, whole), _metrics(b, whole)
    out = {}
    for m in METRICS:
        va, vb = float(pa[m][0]), float(pb[m][0])
        delta = _interval(vb - va, mb[m] - ma[m])
        ratio = None
        if m in POSITIVE_METRICS and va > 0:
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = _interval(vb / va, mb[m] / ma[m])
        out[m] = Comparison(m, va, vb, delta, ratio)
    return out


def _interval(point: float, draws: np.ndarray) -> Estimate:
    """The point estimate with the 95% percentile interval of its bootstrap draws; draws that are undefined (a
    resample without suggestions, a zero denominator) are left out."""
    ok = draws[np.isfinite(draws)]
    if len(ok) == 0:
        return Estimate(point, float("nan"), float("nan"))
    low, high = np.percentile(ok, [2.5, 97.5])
    return Estimate(point, float(low), float(high))


def claim_line(comparisons: dict[str, Comparison], a: str, b: str, n: int) -> str:
    """What the held-out replay supports, and only that: the metrics whose paired interval excludes 0, as a ratio
    where the metric cannot be negative and a difference otherwise; the rest named as not significant."""
    moved = [c for c in comparisons.values() if c.significant]
    flat = [c for c in comparisons.values() if not c.significant]
    head = f"learning claim ({b} against {a}, {n} paired held-out requests, 95% intervals): "
    text = head + ("; ".join(c.describe() for c in moved) if moved else "no significant change")
    if flat:
        text += "\n  not significant: " + "; ".join(c.describe() for c in flat)
    return text
