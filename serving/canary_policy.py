"""The canary ramp's decision rule: per look, guardrails first, then the primary metric.

A ramp walks the canary weight through `steps` (5% → 25% → 50% by default; passing the last one
promotes to 100%). Every look compares everything both arms have served since the canary started:

    1. guardrails (any one fails → roll back): served-weight check, canary error rate above control's by
       more than max_error_rate (always-valid lower bound), p99 latency (the share of canary requests
       slower than max_p99_ratio x control's p99 + p99_slack_ms above control's share by more than the
       1% a p99 allows, always-valid lower bound), accepted characters per request significantly lower
       (a model that stops suggesting must not win)
    2. primary metric (reward per request by default): significantly lower → roll back
    3. step complete (>= min_samples canary outcomes in this step):
          not the last step → advance;  last step → promote if the primary is significantly better
    4. a step past max_step_s → inconclusive: roll back, or ask a human (on_inconclusive='ask')

Error budget: the A/A false-alarm rate (a rollback for a regression, or a promotion, when both arms
serve the same weights) is at most alpha by a union bound: the primary test runs at alpha/2 and the
three statistical guardrails (accepted chars, error rate, latency) at alpha/6 each; each is an
always-valid mSPRT (serving/canary_stats.py), so looking after every batch costs nothing, and none
counts before both arms have min_test_samples outcomes. The latency guardrail is a test, not a
comparison of two sample p99s: a p99 of a few hundred outcomes is their second or third largest, and a
fresh engine's two slow requests would fail a candidate that is as fast as control everywhere else.
Accept rate is reported, not acted on.

Known limits: arms are compared over everything since the canary started while the canary's share
grows, so a reward trend over time biases the comparison; and a step advances on "no evidence of
harm", so a small regression (20% relative) is often caught only at a later step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from serving.canary_stats import Comparison, Summary, msprt
from tidal.section import Section

Metric = Literal["reward", "accepted", "accepted_chars"]
Action = Literal["wait", "advance", "promote", "rollback", "inconclusive"]


class CanaryConfig(Section):
    steps: list[float] = Field(default_factory=lambda: [0.05, 0.25, 0.5], description=(
        "Canary traffic share of each step, increasing; passing the last step promotes to 100%."))
    min_samples: int = Field(200, ge=10, description="Canary outcomes a step needs before it may end.")
    min_test_samples: int = Field(30, ge=2, description="Outcomes per arm before any sequential test may decide (small-n guard).")
    max_step_s: float = Field(1800.0, gt=0, description="A step without a decision by then is inconclusive.")
    alpha: float = Field(0.05, gt=0, lt=1, description="A/A false-alarm budget of the whole ramp (rollbacks + promotions).")
    primary: Metric = Field("reward", description="Metric that must improve significantly for promotion.")
    mixture_sd: float = Field(0.2, gt=0, description="mSPRT mixture scale, in pooled standard deviations: the effect size the tests are tuned to.")
    max_error_rate: float = Field(0.02, ge=0, le=1, description="Canary error rate above control's by more than this (with always-valid confidence) fails the ramp.")
    max_p99_ratio: float = Field(1.5, ge=1, description="Canary p99 latency may be this many times control's p99 ...")
    p99_slack_ms: float = Field(50.0, ge=0, description=(
        "... plus this many ms: the latency guardrail fails once more than 1% of canary requests are slower than that, "
        "with always-valid confidence (a test on the share of slow requests, not on two sample p99s)."))
    on_inconclusive: Literal["rollback", "ask"] = Field("rollback", description="At max_step_s: roll back, or pause the flow for a human decision.")
    approval_timeout_s: float = Field(86400.0, gt=0, le=28 * 86400, description="How long an 'ask' pause waits for a human before the flow fails.")
    feedback_wait_s: float = Field(30.0, ge=0, description="A completion without feedback counts (as 'ignored') once this old.")
    poll_s: float = Field(5.0, gt=0, description="Seconds between looks.")
    unload_grace_s: float = Field(60.0, ge=0, description="After promotion, the old champion stays loaded this long (instant rollback).")
    watchdog_s: float = Field(60.0, gt=0, description=(
        "The release checks in with the gateway at every look; a canary whose release has not checked in for this "
        "long (its run was killed, crashed or lost the gateway) is rolled back by the gateway itself."))

    @model_validator(mode="after")
    def _check(self) -> CanaryConfig:
        s = self.steps
        if not s or any(not 0 < w < 1 for w in s) or any(b <= a for a, b in zip(s, s[1:])):
            raise ValueError(f"canary.steps={s}: need increasing shares in (0, 1), e.g. [0.05, 0.25, 0.5]")
        if self.watchdog_s < 3 * self.poll_s:
            raise ValueError(f"canary.watchdog_s={self.watchdog_s} is under 3 × canary.poll_s={self.poll_s}: a slow look "
                             f"would have a healthy release rolled back; raise watchdog_s to at least {3 * self.poll_s:g}")
        return self


@dataclass(frozen=True)
class Outcome:
    """One resolved request of one arm (from the logs): what the user got."""

    arm: str  # "control" | "canary"
    reward: float
    accepted: float  # 1.0 accepted, else 0.0
    accepted_chars: float
    latency_ms: float
    time_ms: int


@dataclass(frozen=True)
class ArmHealth:
    """Live counters of one arm since the canary started (errors never reach the logs)."""

    requests: int = 0
    errors: int = 0


@dataclass
class Look:
    """The result of one look: the action and everything it was based on (one row of the step table)."""

    action: Action
    reason: str
    step: int
    weight: float
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict:
        out = {"step": self.step + 1, "weight": self.weight, "action": self.action, "reason": self.reason, **self.figures}
        for name, c in self.comparisons.items():
            out[f"{name}_delta"] = round(c.delta, 5)
            out[f"{name}_ci"] = f"[{c.low:.4f}, {c.high:.4f}]"
        return out


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def look(cfg: CanaryConfig, step: int, outcomes: list[Outcome], step_canary_n: int, step_elapsed_s: float,
         health: dict[str, ArmHealth], probe_ok: bool = True) -> Look:
    """Decide at one look. `outcomes`: both arms since the canary started; `step_canary_n`: canary outcomes
    collected since this step began."""
    weight = cfg.steps[step]
    arms = {a: [o for o in outcomes if o.arm == a] for a in ("control", "canary")}
    guard_alpha = cfg.alpha / 6  # three guardrail tests share half the budget; the primary has the other half
    comps = {m: msprt(m, Summary.of([getattr(o, m) for o in arms["control"]]),
                      Summary.of([getattr(o, m) for o in arms["canary"]]),
                      cfg.alpha / 2 if m == cfg.primary else guard_alpha, cfg.mixture_sd, cfg.min_test_samples)
             for m in ("reward", "accepted", "accepted_chars")}
    control_h, canary_h = health.get("control", ArmHealth()), health.get("canary", ArmHealth())
    errors = msprt("error_rate", Summary.of_rate(control_h.errors, control_h.requests),
                   Summary.of_rate(canary_h.errors, canary_h.requests), guard_alpha, cfg.mixture_sd, cfg.min_test_samples)
    err_c, err_k = errors.control.mean, errors.canary.mean
    p99_c, p99_k = _p99([o.latency_ms for o in arms["control"]]), _p99([o.latency_ms for o in arms["canary"]])
    # The canary's p99 is above `slow_ms` exactly when more than 1% of its requests are; control's share is at most
    # 1% (slow_ms >= its p99). So "canary share - control share > 1%", with always-valid confidence, shows it.
    slow_ms = cfg.max_p99_ratio * p99_c + cfg.p99_slack_ms
    slow = msprt("slow_share", *(Summary.of_rate(sum(o.latency_ms > slow_ms for o in arms[a]), len(arms[a]))
                                 for a in ("control", "canary")), guard_alpha, cfg.mixture_sd, cfg.min_test_samples)
    figures = {"n_control": len(arms["control"]), "n_canary": len(arms["canary"]), "step_canary_n": step_canary_n,
               "error_rate_control": round(err_c, 5), "error_rate_canary": round(err_k, 5),
               "p99_ms_control": round(p99_c, 1), "p99_ms_canary": round(p99_k, 1),
               "slow_share_canary": round(slow.canary.mean, 5), "step_elapsed_s": round(step_elapsed_s, 1)}

    def out(action: Action, reason: str) -> Look:
        return Look(action, reason, step, weight, {**comps, "error_rate": errors, "slow_share": slow}, figures)

    if not probe_ok:
        return out("rollback", "served-weight check failed on the canary's replicas")
    if errors.low > cfg.max_error_rate:  # confidently more than max_error_rate above control
        return out("rollback", f"error rate {err_k:.3%} vs control {err_c:.3%} (excess in [{errors.low:.3%}, "
                               f"{errors.high:.3%}], allowed +{cfg.max_error_rate:.1%})")
    if slow.low > 0.01:
        return out("rollback", f"p99 latency {p99_k:.0f} ms vs control {p99_c:.0f} ms: {slow.canary.mean:.1%} of canary "
                               f"requests slower than {slow_ms:.0f} ms ({cfg.max_p99_ratio}x + {cfg.p99_slack_ms:.0f} ms), "
                               f"control {slow.control.mean:.1%} (excess in [{slow.low:.1%}, {slow.high:.1%}], allowed +1%)")
    if cfg.primary != "accepted_chars" and comps["accepted_chars"].worse:
        c = comps["accepted_chars"]
        return out("rollback", f"accepted chars per request fell: {c.canary.mean:.3f} vs {c.control.mean:.3f} "
                               f"(delta in [{c.low:.3f}, {c.high:.3f}])")
    primary = comps[cfg.primary]
    if primary.worse:
        return out("rollback", f"{cfg.primary} fell: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
                               f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f})")
    if step_canary_n >= cfg.min_samples:
        if step + 1 < len(cfg.steps):
            return out("advance", f"no regression after {step_canary_n} canary outcomes at {weight:.0%}")
        if primary.better:
            return out("promote", f"{cfg.primary} rose: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
                                  f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f})")
    if step_elapsed_s >= cfg.max_step_s:
        return out("inconclusive", f"no decision within {cfg.max_step_s:.0f} s at {weight:.0%} "
                                   f"({step_canary_n} canary outcomes this step, {cfg.primary} p={primary.p_value:.4f})")
    if step_canary_n >= cfg.min_samples:  # the last step, complete, without a significant improvement yet
        return out("wait", f"{cfg.primary} not significantly better yet after {step_canary_n} canary outcomes at {weight:.0%} "
                           f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f})")
    return out("wait", f"{step_canary_n}/{cfg.min_samples} canary outcomes at {weight:.0%}")


class Ramp:
    """A ramp in progress: which step, since when, and every look so far (the audit's step table).

    The promote flow feeds it outcomes read from the logs; simulations feed it sampled outcomes.
    Only `advance` changes the step; `promote`, `rollback` and `inconclusive` end the ramp.
    """

    def __init__(self, cfg: CanaryConfig, now_s: float):
        self.cfg, self.step, self.step_started_s, self.step_base_n = cfg, 0, now_s, 0
        self.looks: list[Look] = []

    @property
    def weight(self) -> float:
        return self.cfg.steps[self.step]

    def observe(self, outcomes: list[Outcome], health: dict[str, ArmHealth], now_s: float, probe_ok: bool = True) -> Look:
        n_canary = sum(1 for o in outcomes if o.arm == "canary")
        result = look(self.cfg, self.step, outcomes, n_canary - self.step_base_n, now_s - self.step_started_s, health,
                      probe_ok)
        self.looks.append(result)
        if result.action == "advance":
            self.step, self.step_started_s, self.step_base_n = self.step + 1, now_s, n_canary
        return result
