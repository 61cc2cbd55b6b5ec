"""The records a canary look reads: each resolved request's outcome, its user's history before the ramp,
each arm's live counters, and the outcomes as columns grouped into strata. Producers (the log reader, the
simulation) and the decision rule (release/policy.py) share them; this module imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import numpy as np

from release.stats import Summary
from tidal.model_settings import CanaryMetric

Metric = CanaryMetric
METRICS: tuple[Metric, ...] = get_args(CanaryMetric)  # tidal.model_settings.CANARY_METRICS says what each is


@dataclass(frozen=True)
class History:
    """One user's outcomes of the control version before the ramp: CUPED's covariates (means per request; NaN for a
    metric none of their requests had, such as a score never given)."""

    n: int
    reward: float
    accepted: float
    accepted_chars: float
    shown_chars: float = math.nan
    thumbs_up: float = math.nan
    thumbs_down: float = math.nan
    score: float = math.nan


def _mean(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return math.fsum(known) / len(known) if known else math.nan


def histories(outcomes: Sequence[Outcome]) -> dict[str, History]:
    """Each user's History from their outcomes (those of the control version before a ramp)."""
    by_user: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_user.setdefault(o.user, []).append(o)
    return {u: History(len(os), *(_mean([getattr(o, m) for o in os]) for m in METRICS)) for u, os in by_user.items() if u}


@dataclass(frozen=True)
class Outcome:
    """One resolved request of one arm (from the logs): what the user got."""

    arm: str  # "control" | "canary"
    reward: float
    accepted: float  # 1.0 accepted, else 0.0
    accepted_chars: float
    latency_ms: float
    time_ms: int
    kind: str = ""  # request kind (a stratum): release.outcomes.request_kind
    history: History | None = None  # the user's outcomes before the ramp, if any
    user: str = ""  # the user's hash (groups a user's outcomes into a History)
    shown_chars: float = 0.0  # characters shown
    thumbs_up: float = 0.0  # 1.0 thumbs up, else 0.0
    thumbs_down: float = 0.0  # 1.0 thumbs down, else 0.0
    score: float = math.nan  # the score rescaled to [0, 1]; NaN: none given (left out of the score's comparison)


@dataclass(frozen=True)
class ArmHealth:
    """Live counters of one arm since the canary started (errors never reach the logs)."""

    requests: int = 0
    errors: int = 0


class Columns:
    """The outcomes as arrays (one per field), for a look over tens of thousands of them. `kinds` maps each
    request kind to its code; pass the same dict to columns that will be concatenated."""

    def __init__(self, outcomes: Sequence[Outcome], kinds: dict[str, int] | None = None):
        self.n, self.kinds = len(outcomes), {} if kinds is None else kinds
        self.canary = np.fromiter((o.arm == "canary" for o in outcomes), bool, self.n)
        self.values = {m: np.fromiter((getattr(o, m) for o in outcomes), float, self.n) for m in METRICS}
        self.history = {
            m: np.fromiter((math.nan if o.history is None else getattr(o.history, m) for o in outcomes), float, self.n)
            for m in METRICS
        }
        self.latency_ms = np.fromiter((o.latency_ms for o in outcomes), float, self.n)
        self.time_ms = np.fromiter((o.time_ms for o in outcomes), np.int64, self.n)
        self.kind = np.fromiter((self.kinds.setdefault(o.kind, len(self.kinds)) for o in outcomes), np.int64, self.n)

    def extend(self, more: Columns) -> Columns:
        """These columns followed by `more` (built with the same kinds)."""
        out = Columns([], self.kinds)
        out.n = self.n + more.n
        for name in ("canary", "latency_ms", "time_ms", "kind"):
            setattr(out, name, np.concatenate([getattr(self, name), getattr(more, name)]))
        out.values = {m: np.concatenate([self.values[m], more.values[m]]) for m in METRICS}
        out.history = {m: np.concatenate([self.history[m], more.history[m]]) for m in METRICS}
        return out


def blocks(values: np.ndarray, canary: np.ndarray, step: np.ndarray, kind: np.ndarray) -> list[list[tuple[Summary, Summary]]]:
    """(control, canary) Summary per request kind, per step served in (small non-negative int codes)."""
    kinds = int(kind.max()) + 1 if len(kind) else 1
    group = (step * kinds + kind) * 2 + canary
    size = 2 * kinds * (int(step.max()) + 1 if len(step) else 1)
    n = np.bincount(group, minlength=size)
    total = np.bincount(group, weights=values, minlength=size)
    mean = np.divide(total, n, out=np.zeros(size), where=n > 0)
    ss = np.bincount(group, weights=(values - mean[group]) ** 2, minlength=size)  # two-pass: exact for large means
    var = np.divide(ss, n - 1, out=np.zeros(size), where=n > 1)
    arm = [Summary(int(n[g]), float(mean[g]), float(var[g])) for g in range(size)]
    pairs = [(arm[2 * s], arm[2 * s + 1]) for s in range(size // 2)]
    return [[p for p in pairs[b * kinds : (b + 1) * kinds] if p[0].n + p[1].n] for b in range(size // (2 * kinds))]
