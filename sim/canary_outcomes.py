"""A seeded simulator of a canary ramp's per-request outcomes: drives `serving.canary_policy.Ramp` in
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
from serving.canary_policy import ArmHealth, CanaryConfig, Outcome, Ramp

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
        if (not 0 <= self.accept_p <= 1 or not 0 <= self.error_rate < 1 or self.mean_chars < 1
                or not 0 < self.show_p <= 1):
            raise ValueError(f"need accept_p in [0, 1], error_rate in [0, 1), mean_chars >= 1, show_p in (0, 1]: {self}")


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


def _serve(rng: np.random.Generator, arms: tuple[ArmModel, ArmModel], rule: RewardRule, user_u: np.ndarray,
           weight: float, first: int, n: int, rate_rps: float) -> tuple[list[Outcome], np.ndarray, np.ndarray]:
    """Serve requests first .. first+n-1 at one canary weight. Returns (outcomes, is_canary, failed).

    Every random array is drawn for every request whatever its arm, in a fixed order, so two runs with
    the same seed see the same users, arrivals and latencies (common random numbers across scenarios).
    """
    canary = user_u[rng.integers(len(user_u), size=n)] < weight
    failed = rng.random(n) < np.where(canary, arms[1].error_rate, arms[0].error_rate)
    accepted = rng.random(n) < np.where(canary, arms[1].accept_p, arms[0].accept_p)
    shown = 1 + rng.poisson(np.where(canary, arms[1].mean_chars, arms[0].mean_chars) - 1)
    latency = rng.lognormal(math.log(LATENCY_MEDIAN_MS), LATENCY_SIGMA, n)
    silent = np.zeros(n, dtype=bool)
    if min(a.show_p for a in arms) < 1:  # drawn only then: ramps without silence keep their streams
        silent = rng.random(n) >= np.where(canary, arms[1].show_p, arms[0].show_p)
    accepted, shown = accepted & ~silent, np.where(silent, 0, shown)
    kept = np.where(accepted, shown, 0)
    events = np.where(silent, "none", np.where(accepted, "accepted", "rejected")).astype(object)
    rewards = rule.rewards(events, kept.astype(np.float64), shown)
    outcomes = [Outcome(ARMS[int(canary[i])], float(rewards[i]), float(accepted[i]), float(kept[i]),
                        float(latency[i]), int((first + i) * 1000 / rate_rps))
                for i in range(n) if not failed[i]]
    return outcomes, canary, failed


def run_ramp(cfg: CanaryConfig, arms: tuple[ArmModel, ArmModel], seed: int, rate_rps: float, look_every: int,
             max_requests: int, *, users: int = 100_000, rule: RewardRule | None = None) -> RampResult:
    """Run one ramp of `arms` = (control, canary) from its first step until it ends or max_requests are served.

    `users`: population size; large by default so the realised canary share tracks the weight closely.
    """
    if rate_rps <= 0 or look_every < 1 or max_requests < 1 or users < 1:
        raise ValueError("need rate_rps > 0, look_every >= 1, max_requests >= 1, users >= 1")
    rng, rule = np.random.default_rng(seed), rule or RewardRule()
    user_u = rng.random(users)  # each user's hash point, as serving.routes.assign computes it
    ramp, outcomes = Ramp(cfg, now_s=0.0), []
    requests = {a: 0 for a in ARMS}
    errors = {a: 0 for a in ARMS}
    served = 0
    while served < max_requests:
        n = min(look_every, max_requests - served)
        batch, canary, failed = _serve(rng, arms, rule, user_u, ramp.weight, served, n, rate_rps)
        outcomes.extend(batch)
        n_canary = int(canary.sum())
        requests["canary"] += n_canary
        requests["control"] += n - n_canary
        errors["canary"] += int((failed & canary).sum())
        errors["control"] += int((failed & ~canary).sum())
        served += n
        health = {a: ArmHealth(requests[a], errors[a]) for a in ARMS}
        step = ramp.step  # the step this look judges (an 'advance' moves ramp.step on)
        result = ramp.observe(outcomes, health, now_s=served / rate_rps)
        if result.action not in ("wait", "advance"):
            return RampResult(result.action, result.reason, served, served / rate_rps, requests["canary"], step,
                              len(ramp.looks), {m: c.delta for m, c in result.comparisons.items()})
    return RampResult("unfinished", f"no decision within {max_requests} requests", served, served / rate_rps,
                      requests["canary"], ramp.step, len(ramp.looks))
