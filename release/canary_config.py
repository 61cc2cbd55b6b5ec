"""A canary's settings (`canary:` in tidal.yaml): its steps, its tests' error budget and sizing, its guardrails'
margins and its clock. The decision rule that reads them is release/policy.py."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from release.canary_records import Metric
from release.stats import StepPlan, plan_step
from tidal.model_settings import LOWER_IS_BETTER, Margins
from tidal.section import Section


class CanaryConfig(Section):
    steps: list[float] = Field(
        default_factory=lambda: [0.05, 0.25, 0.5],
        description=("Canary traffic share of each step, increasing; passing the last step promotes to 100%."),
    )
    min_samples: int = Field(
        50,
        ge=10,
        description=(
            "Canary outcomes a step needs before it may end (a floor: the tests decide when it does; at 5% of traffic 50 "
            "holds the first step for 1,000 requests, 200 would hold it for 4,000, longer than a clear improvement needs)."
        ),
    )
    min_test_samples: int = Field(30, ge=2, description="Outcomes per arm before any sequential test may decide (small-n guard).")
    max_step_s: float = Field(1800.0, gt=0, description="A step without a decision by then is inconclusive.")
    max_step_outcomes: int | None = Field(
        None,
        ge=1,
        description=(
            "A step without a decision after this many outcomes of both arms is inconclusive, however long they took: "
            "a bound on evidence, not time, so a step in a trough of traffic waits for the day's requests (max_step_s "
            "still applies; whichever comes first ends the step). None: max_step_s alone."
        ),
    )
    alpha: float = Field(0.05, gt=0, lt=1, description="A/A false-alarm budget of the whole ramp (rollbacks + promotions).")
    primary: Metric = Field("reward", description="Metric that must improve significantly for promotion.")
    mixture_sd: float = Field(
        0.2,
        gt=0,
        description=(
            "mSPRT mixture scale, in pooled standard deviations: the effect size the tests are tuned to "
            "(release.stats.fit_mixture_sd fits it to past canaries' effects)."
        ),
    )
    detect_regression_sd: float = Field(
        0.13,
        gt=0,
        description=(
            "A step before the last advances only once the primary is shown not worse than control by this many pooled "
            "standard deviations: the regression each step must decide (0.13 ~ an accept rate 20% lower at 0.30 under the "
            "default reward rule). Smaller catches smaller regressions at the first step and makes every step longer."
        ),
    )
    advance_risk: float = Field(
        0.2,
        gt=0,
        lt=1,
        description=(
            "Level of the test that lets a step advance: the chance that a candidate worse by detect_regression_sd is "
            "let through to the next step (it is still tested there). Advancing is not a release decision and spends "
            "none of alpha; larger advances a good candidate sooner and lets more regressions reach the next step."
        ),
    )
    stratify: bool = Field(
        True,
        description=(
            "Compare the arms within strata (ramp step x request kind; kinds weighted by their share of traffic, steps by "
            "precision); false pools everything "
            "since the canary started (biased by any trend while the weight rises, and noisier when kinds differ)."
        ),
    )
    cuped: bool = Field(
        True,
        description=(
            "Adjust each outcome by its user's outcomes of the control version before the ramp (CUPED); users without "
            "history are left as they are."
        ),
    )
    margins: Margins = Field(
        default_factory=Margins, description="Non-inferiority margins of the guardrails (models may override)."
    )
    max_p99_ratio: float = Field(1.5, ge=1, description="Canary p99 latency may be this many times control's p99 ...")
    p99_slack_ms: float = Field(
        50.0,
        ge=0,
        description=(
            "... plus this many ms: a request slower than that counts as slow for the latency guardrail (margins.slow_share)."
        ),
    )
    on_inconclusive: Literal["rollback", "ask"] = Field(
        "rollback", description="At max_step_s: roll back, or pause the flow for a human decision."
    )
    approve_before: list[float] = Field(
        default_factory=list,
        description=(
            "Steps that wait for a typed human approval before traffic moves to them: any of `steps`, or 1.0 for the "
            "promotion itself ([1.0]: always ask before 100%). The canary holds its current weight meanwhile."
        ),
    )
    approval_timeout_s: float = Field(
        86400.0,
        gt=0,
        le=28 * 86400,
        description="How long a pause for a human ('ask', approve_before) waits before the flow fails.",
    )
    approval_poll_s: int = Field(
        2,
        ge=1,
        description="How often a paused release asks Prefect whether the human answered (Prefect's own default: 10 s).",
    )
    feedback_wait_s: float = Field(30.0, ge=0, description="A completion without feedback counts (as 'ignored') once this old.")
    history_s: float = Field(
        3600.0, ge=0, description=("How far before the canary's start its users' outcomes are read for CUPED (0 = none).")
    )
    poll_s: float = Field(5.0, gt=0, description="Seconds between looks.")
    unload_grace_s: float = Field(
        60.0, ge=0, description="After promotion, the old champion stays loaded this long (instant rollback)."
    )
    watchdog_s: float = Field(
        60.0,
        gt=0,
        description=(
            "The release checks in with the gateway at every look; a canary whose release has not checked in for this "
            "long (its run was killed, crashed or lost the gateway) is rolled back by the gateway itself."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> CanaryConfig:
        s = self.steps
        if not s or any(not 0 < w < 1 for w in s) or any(b <= a for a, b in zip(s, s[1:])):
            raise ValueError(f"canary.steps={s}: need increasing shares in (0, 1), e.g. [0.05, 0.25, 0.5]")
        if self.watchdog_s < 3 * self.poll_s:
            raise ValueError(
                f"canary.watchdog_s={self.watchdog_s} is under 3 × canary.poll_s={self.poll_s}: a slow look "
                f"would have a healthy release rolled back; raise watchdog_s to at least {3 * self.poll_s:g}"
            )
        if self.max_step_outcomes is not None and self.max_step_outcomes * s[0] < self.min_samples:
            raise ValueError(
                f"canary.max_step_outcomes={self.max_step_outcomes} would end the first step ({s[0]:.0%} of traffic) "
                f"before it has canary.min_samples={self.min_samples} canary outcomes (~{self.max_step_outcomes * s[0]:.0f}); "
                f"raise max_step_outcomes to at least {math.ceil(self.min_samples / s[0])} or lower min_samples"
            )
        if self.primary in LOWER_IS_BETTER:
            raise ValueError(
                f"canary.primary={self.primary!r}: the primary must be a metric where higher is better; guard it in "
                "models[].canary.guardrails instead"
            )
        if stray := [w for w in self.approve_before if w != 1.0 and w not in s]:
            raise ValueError(
                f"canary.approve_before={self.approve_before}: {stray} is not a step; use weights from "
                f"canary.steps={s}, or 1.0 for the promotion"
            )
        return self

    def plan(self) -> list[StepPlan]:
        """Each step's requests to roll back a detect_regression_sd regression (power 0.8), or to clear it (median)."""
        return [
            plan_step(w, self.detect_regression_sd, self.alpha / 2, self.mixture_sd, clear_alpha=self.advance_risk)
            for w in self.steps
        ]
