"""A seeded simulator of a canary ramp's per-request outcomes: drives `release.policy.Ramp` in
milliseconds, without servers, so the release plane's error rates and detection delays can be measured.

What is simulated, per request, and why:
  * routing: a fixed population of users, each with a uniform point u; a user is on the canary iff
    u < the ramp's current weight, the rule of `serving.routes.assign` (sticky, and raising the weight
    only moves users in). A request comes from a uniformly drawn user.
  * errors: with the arm's `error_rate` a request fails; it is counted in that arm's `ArmHealth` and
    yields no outcome (errors never reach the logs, as in the gateway).
  * the user's verdict: accepted with the arm's `accept_p`, else rejected (every completion shown gets one;
    no 'partial' events, so the reward is two-valued like the default rule's).
  * silence: an arm shows a completion with probability `show_p` (1 by default); otherwise the completion
    is empty (event 'none', the rule's `empty` reward, 0 characters): a model that has learned to abstain.
  * characters: the completion shown has 1 + Poisson(mean_chars - 1) characters; an accepted one keeps
    them all, a rejected one keeps 0.
  * reward: the model's reward rule (`RewardRule()` by default: +0.75 accepted, -0.25 rejected), applied
    through `RewardRule.rewards`, so a changed rule changes the simulation the same way.
  * latency: log-normal (median 120 ms), the same for both arms: the latency guardrail must stay quiet.
  * who asks what (`Population`, none of it by default): users differ (each user's accept probability is the
    arm's times the user's own factor, Gamma-distributed with mean 1 and coefficient of variation
    `user_spread`), requests come in kinds (each kind's accept probability is the arm's times its factor),
    and each user has Poisson(`history_requests`) outcomes of the control model before the ramp (the
    covariates CUPED uses). Both arms see the same users and kinds: the canary changes `accept_p` only.
  * time: requests arrive evenly at `rate_rps`; the ramp looks after every `look_every` requests (in
    production it looks every `poll_s` seconds, i.e. about poll_s * rate_rps requests).

Optimistic on purpose: every served request is resolved at the next look. Production outcomes wait for
feedback (or `feedback_wait_s`), so real decisions come that much later; the request counts here are the
statistical part of the delay only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from data_contracts.rewards import RewardRule
from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth, History, Outcome
from release.policy import Ramp
from tidal.model_settings import Margins

LATENCY_MEDIAN_MS = 120.0  # both arms: a typical small-model completion round trip
LATENCY_SIGMA = 0.35  # log-normal shape: p99 ~ 2.3x the median
ARMS = ("control", "canary")


@dataclass(frozen=True)
class ArmModel:
    """How one arm's users respond: accept probability (of a completion shown), characters per completion,
    failure rate, and the share of requests that get a completion at all."""

    accept_p: float
    mean_chars: float = 24.0
    error_rate: float = 0.0
    show_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.accept_p <= 1 or not 0 <= self.error_rate < 1 or self.mean_chars < 1 or not 0 < self.show_p <= 1:
            raise ValueError(f"need accept_p in [0, 1], error_rate in [0, 1), mean_chars >= 1, show_p in (0, 1]: {self}")


@dataclass(frozen=True)
class Population:
    """The users and requests both arms serve: how much users differ, the request kinds, and each user's history."""

    user_spread: float = 0.0  # coefficient of variation of the per-user factor on accept_p (0 = all alike)
    kinds: tuple[tuple[str, float, float], ...] = (("", 1.0, 1.0),)  # (name, share of requests, factor on accept_p)
    history_requests: float = 0.0  # mean outcomes per user before the ramp (0 = no history)

    def __post_init__(self) -> None:
        shares = [k[1] for k in self.kinds]
        if (
            self.user_spread < 0
            or self.history_requests < 0
            or not self.kinds
            or min(shares) <= 0
            or abs(sum(shares) - 1) > 1e-9
            or min(k[2] for k in self.kinds) < 0
        ):
            raise ValueError(f"need user_spread >= 0, history_requests >= 0, kind shares > 0 summing to 1, factors >= 0: {self}")


@dataclass
class _Users:
    """A drawn population: each user's hash point, accept factor and (lazily built) History."""

    u: np.ndarray
    factor: np.ndarray
    history: dict[int, History | None]
    stats: tuple[np.ndarray, ...] | None  # (n, reward sum, accepted sum, chars sum) per user, or None


@dataclass(frozen=True)
class RampResult:
    """How one simulated ramp ended. `action` is the ending look's action, or 'unfinished' at max_requests."""

    action: str
    reason: str
    requests: int  # all requests served until the decision (both arms, errors included)
    seconds: float  # simulated time until the decision: requests / rate_rps
    canary_requests: int
    step: int  # step index at the decision (0 = the first, smallest weight)
    looks: int
    # canary − control per metric at the ending look (reward, accepted, accepted_chars, error_rate)
    deltas: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_share(self) -> float:
        """Share of all requests until the decision that the canary served: the users a bad model reached."""
        return self.canary_requests / self.requests if self.requests else 0.0


def _draw_users(rng: np.random.Generator, users: int, pop: Population, control: ArmModel, rule: RewardRule) -> _Users:
    u = rng.random(users)  # each user's hash point, as serving.routes.assign computes it
    factor = np.ones(users)
    if pop.user_spread > 0:
        shape = 1 / pop.user_spread**2
        factor = rng.gamma(shape, 1 / shape, users)
    stats = None
    if pop.history_requests > 0:
        h = rng.poisson(pop.history_requests, users)
        who = np.repeat(np.arange(users), h)
        kind = _kinds(rng, pop, len(who))
        p = np.clip(control.accept_p * factor[who] * np.array([k[2] for k in pop.kinds])[kind], 0, 1)
        accepted = rng.random(len(who)) < p
        shown = 1 + rng.poisson(control.mean_chars - 1, len(who))
        kept = np.where(accepted, shown, 0)
        rewards = rule.rewards(np.where(accepted, "accepted", "rejected").astype(object), kept.astype(float), shown)
        stats = (h, *(np.bincount(who, weights=w, minlength=users) for w in (rewards, accepted.astype(float), kept)))
    return _Users(u, factor, {}, stats)


def _kinds(rng: np.random.Generator, pop: Population, n: int) -> np.ndarray:
    if len(pop.kinds) == 1:
        return np.zeros(n, int)
    return rng.choice(len(pop.kinds), size=n, p=[k[1] for k in pop.kinds])


def _history(users: _Users, i: int) -> History | None:
    if users.stats is None:
        return None
    if i not in users.history:
        n, reward, accepted, chars = (float(a[i]) for a in users.stats)
        users.history[i] = History(int(n), reward / n, accepted / n, chars / n) if n else None
    return users.history[i]


def _serve(
    rng: np.random.Generator,
    arms: tuple[ArmModel, ArmModel],
    rule: RewardRule,
    users: _Users | np.ndarray,
    weight: float,
    first: int,
    n: int,
    rate_rps: float,
    pop: Population = Population(),
) -> tuple[list[Outcome], np.ndarray, np.ndarray]:
    """Serve requests first .. first+n-1 at one canary weight. Returns (outcomes, is_canary, failed).

    Every random array is drawn for every request whatever its arm, in a fixed order, so two runs with
    the same seed see the same users, arrivals and latencies (common random numbers across scenarios).
    """
    if isinstance(users, np.ndarray):
        users = _Users(users, np.ones(len(users)), {}, None)
    who = rng.integers(len(users.u), size=n)
    canary = users.u[who] < weight
    failed = rng.random(n) < np.where(canary, arms[1].error_rate, arms[0].error_rate)
    kind = _kinds(rng, pop, n)
    factor = users.factor[who] * np.array([k[2] for k in pop.kinds])[kind]
    accepted = rng.random(n) < np.clip(np.where(canary, arms[1].accept_p, arms[0].accept_p) * factor, 0, 1)
    shown = 1 + rng.poisson(np.where(canary, arms[1].mean_chars, arms[0].mean_chars) - 1)
    latency = rng.lognormal(math.log(LATENCY_MEDIAN_MS), LATENCY_SIGMA, n)
    silent = np.zeros(n, dtype=bool)
    if min(a.show_p for a in arms) < 1:  # drawn only then: ramps without silence keep their streams
        silent = rng.random(n) >= np.where(canary, arms[1].show_p, arms[0].show_p)
    accepted, shown = accepted & ~silent, np.where(silent, 0, shown)
    kept = np.where(accepted, shown, 0)
    events = np.where(silent, "none", np.where(accepted, "accepted", "rejected")).astype(object)
    rewards = rule.rewards(events, kept.astype(np.float64), shown)
    outcomes = [
        Outcome(
            ARMS[int(canary[i])],
            float(rewards[i]),
            float(accepted[i]),
            float(kept[i]),
            float(latency[i]),
            int((first + i) * 1000 / rate_rps),
            pop.kinds[kind[i]][0],
            _history(users, int(who[i])),
        )
        for i in range(n)
        if not failed[i]
    ]
    return outcomes, canary, failed


def sample(
    arms: tuple[ArmModel, ArmModel],
    weight: float,
    n: int,
    seed: int,
    *,
    users: int = 100_000,
    rule: RewardRule | None = None,
    population: Population = Population(),
    rate_rps: float = 20.0,
) -> list[Outcome]:
    """n requests' outcomes at a fixed canary weight (no ramp): for measuring estimators on one sample."""
    rng, rule = np.random.default_rng(seed), rule or RewardRule()
    drawn = _draw_users(rng, users, population, arms[0], rule)
    return _serve(rng, arms, rule, drawn, weight, 0, n, rate_rps, population)[0]


def run_ramp(
    cfg: CanaryConfig,
    arms: tuple[ArmModel, ArmModel],
    seed: int,
    rate_rps: float,
    look_every: int,
    max_requests: int,
    *,
    users: int = 100_000,
    rule: RewardRule | None = None,
    population: Population = Population(),
    margins: Margins | None = None,
) -> RampResult:
    """Run one ramp of `arms` = (control, canary) from its first step until it ends or max_requests are served.

    `users`: population size; large by default so the realised canary share tracks the weight closely.
    """
    if rate_rps <= 0 or look_every < 1 or max_requests < 1 or users < 1:
        raise ValueError("need rate_rps > 0, look_every >= 1, max_requests >= 1, users >= 1")
    rng, rule = np.random.default_rng(seed), rule or RewardRule()
    drawn = _draw_users(rng, users, population, arms[0], rule)
    ramp, outcomes = Ramp(cfg, now_s=0.0, margins=margins), []
    requests = {a: 0 for a in ARMS}
    errors = {a: 0 for a in ARMS}
    served = 0
    while served < max_requests:
        n = min(look_every, max_requests - served)
        batch, canary, failed = _serve(rng, arms, rule, drawn, ramp.weight, served, n, rate_rps, population)
        outcomes.extend(batch)
        n_canary = int(canary.sum())
        requests["canary"] += n_canary
        requests["control"] += n - n_canary
        errors["canary"] += int((failed & canary).sum())
        errors["control"] += int((failed & ~canary).sum())
        served += n
        health = {a: ArmHealth(requests[a], errors[a]) for a in ARMS}
        step = ramp.step  # the step this look judges (an 'advance' moves ramp.step on)
        result = ramp.observe(outcomes, health, now_s=served / rate_rps, clock_ms=int(served * 1000 / rate_rps))
        if result.action not in ("wait", "advance"):
            return RampResult(
                result.action,
                result.reason,
                served,
                served / rate_rps,
                requests["canary"],
                step,
                len(ramp.looks),
                {m: c.delta for m, c in result.comparisons.items()},
            )
    return RampResult(
        "unfinished",
        f"no decision within {max_requests} requests",
        served,
        served / rate_rps,
        requests["canary"],
        ramp.step,
        len(ramp.looks),
    )
