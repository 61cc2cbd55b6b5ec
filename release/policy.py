"""The canary ramp's decision rule: per look, guardrails first, then the primary metric.

A ramp walks the canary weight through `steps` (5% → 25% → 50% by default; passing the last one
promotes to 100%). Every look compares everything both arms have served since the canary started,
within strata (the ramp step a request was served in × its request kind: arms are compared only with
requests served at the same weight and of the same kind), each outcome adjusted by its user's outcomes
before the ramp (CUPED). Each test's three answers are read off its always-valid confidence sequence
on canary − control: shown worse by more than the margin, shown not worse by more than the margin
(non-inferior), or not yet known.

    1. guardrails (any one shown worse than its margin → roll back): served-weight check, error rate
       (absolute margin), p99 latency (the share of canary requests slower than max_p99_ratio × control's
       p99 + p99_slack_ms, above control's share; the margin is the 1% a p99 allows), accepted characters per
       request (a relative margin: a model that stops suggesting must not win)
    2. primary metric (reward per request by default): significantly lower → roll back
    3. a step that is not the last advances once it has >= min_samples canary outcomes and the primary and
       accepted characters per request are each shown not worse than control by detect_regression_sd pooled
       standard deviations at level advance_risk: each step decides the regression it must catch before more
       users see the candidate (`plan()` sizes it by power). Advancing releases nothing, so it is tested at the
       exposure risk one accepts (the chance a candidate worse by that much reaches the next step, where it is
       tested again), not at alpha
    4. the last step promotes once the primary is significantly better AND every guardrail is shown
       non-inferior; "not significantly worse" is not enough
    5. a step past max_step_s → inconclusive (never promoted): roll back, or ask a human (on_inconclusive='ask')

Error budget: the A/A false-alarm rate (a rollback for a regression, or a promotion, when both arms
serve the same weights) is at most alpha by a union bound: the primary test runs at alpha/2 and the
three statistical guardrails (accepted chars, error rate, latency) at alpha/6 each; each is an
always-valid mSPRT (release/stats.py), so looking after every batch costs nothing, and none
counts before both arms have min_test_samples outcomes. The latency guardrail is a test, not a
comparison of two sample p99s: a p99 of a few hundred outcomes is their second or third largest, and a
fresh engine's two slow requests would fail a candidate that is as fast as control everywhere else.
Accept rate is reported, not acted on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from release.canary_records import METRICS, ArmHealth, Columns, Metric, Outcome, blocks
from release.stats import Comparison, StepPlan, Summary, cuped, msprt, plan_step, pooled, stratified_msprt
from tidal.model_settings import Margins
from tidal.section import Section

Action = Literal["wait", "advance", "promote", "rollback", "inconclusive"]


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


@dataclass
class Look:
    """The result of one look: the action and everything it was based on (one row of the step table)."""

    action: Action
    reason: str
    step: int
    weight: float
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    # metric → the margin its decision used, in its own units: a guardrail's non-inferiority margin, and for the
    # primary the regression a step must exclude before it advances
    margins: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict:
        out = {"step": self.step + 1, "weight": self.weight, "action": self.action, "reason": self.reason, **self.figures}
        for name, c in self.comparisons.items():
            out[f"{name}_delta"] = round(c.delta, 5)
            out[f"{name}_ci"] = f"[{c.low:.4f}, {c.high:.4f}]"
        return out


def _p99(values: np.ndarray) -> float:
    if not len(values):
        return math.nan
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)])


def _compare(
    cfg: CanaryConfig,
    name: str,
    values: np.ndarray,
    cols: Columns,
    strata: tuple[np.ndarray, np.ndarray],
    alpha: float,
    covariate: np.ndarray | None = None,
) -> Comparison:
    """The stratified test of one metric on its CUPED-adjusted values; the arms' summaries reported are the raw ones.
    strata: (step served in, request kind) codes per outcome."""
    tested = cuped(values, covariate) if cfg.cuped and covariate is not None else values
    c = stratified_msprt(
        name,
        blocks(tested, cols.canary, *strata),
        alpha,
        cfg.mixture_sd,
        cfg.min_test_samples,
        min_stratum_n=10 if cfg.stratify else 2,
    )
    raw = [
        Summary(len(v), float(v.mean()) if len(v) else 0.0, float(v.var(ddof=1)) if len(v) > 1 else 0.0)
        for v in (values[~cols.canary], values[cols.canary])
    ]
    return replace(c, control=raw[0], canary=raw[1])


def look(
    cfg: CanaryConfig,
    step: int,
    outcomes: Sequence[Outcome] | Columns,
    step_canary_n: int,
    step_elapsed_s: float,
    health: dict[str, ArmHealth],
    probe_ok: bool = True,
    step_starts_ms: Sequence[int] = (),
    margins: Margins | None = None,
) -> Look:
    """Decide at one look. `outcomes`: both arms since the canary started; `step_canary_n`: canary outcomes
    collected since this step began; `step_starts_ms`: when each step after the first began (the clock of
    Outcome.time_ms), the strata of the ramp; `margins`: the model's, else cfg.margins."""
    weight, margins = cfg.steps[step], margins or cfg.margins
    cols = outcomes if isinstance(outcomes, Columns) else Columns(outcomes)
    if cfg.stratify:
        strata = (np.searchsorted(np.asarray(step_starts_ms, np.int64), cols.time_ms, side="right"), cols.kind)
    else:
        strata = (np.zeros(cols.n, np.int64), np.zeros(cols.n, np.int64))
    guard_alpha = cfg.alpha / 6  # three guardrail tests share half the budget; the primary has the other half
    comps = {
        m: _compare(cfg, m, cols.values[m], cols, strata, cfg.alpha / 2 if m == cfg.primary else guard_alpha, cols.history[m])
        for m in METRICS
    }
    control_h, canary_h = health.get("control", ArmHealth()), health.get("canary", ArmHealth())
    errors = msprt(
        "error_rate",
        Summary.of_rate(control_h.errors, control_h.requests),
        Summary.of_rate(canary_h.errors, canary_h.requests),
        guard_alpha,
        cfg.mixture_sd,
        cfg.min_test_samples,
    )
    p99_c, p99_k = _p99(cols.latency_ms[~cols.canary]), _p99(cols.latency_ms[cols.canary])
    # The canary's p99 is above `slow_ms` exactly when more than 1% of its requests are; control's share is at most
    # 1% (slow_ms >= its p99). So "canary share - control share > margin", with always-valid confidence, shows it.
    slow_ms = cfg.max_p99_ratio * p99_c + cfg.p99_slack_ms
    slow = _compare(cfg, "slow_share", (cols.latency_ms > slow_ms).astype(float), cols, strata, guard_alpha)
    chars = comps["accepted_chars"]
    chars_margin = margins.accepted_chars * abs(chars.control.mean)
    primary = comps[cfg.primary]
    regression = cfg.detect_regression_sd * math.sqrt(pooled(primary.control, primary.canary).var)
    figures = {
        "n_control": int((~cols.canary).sum()),
        "n_canary": int(cols.canary.sum()),
        "step_canary_n": step_canary_n,
        "error_rate_control": round(errors.control.mean, 5),
        "error_rate_canary": round(errors.canary.mean, 5),
        "p99_ms_control": round(p99_c, 1),
        "p99_ms_canary": round(p99_k, 1),
        "slow_share_canary": round(slow.canary.mean, 5),
        "step_elapsed_s": round(step_elapsed_s, 1),
    }

    def out(action: Action, reason: str) -> Look:
        return Look(
            action,
            reason,
            step,
            weight,
            {**comps, "error_rate": errors, "slow_share": slow},
            figures,
            {
                cfg.primary: regression,
                "accepted_chars": chars_margin,
                "error_rate": margins.error_rate,
                "slow_share": margins.slow_share,
            },
        )

    if not probe_ok:
        return out("rollback", "served-weight check failed on the canary's replicas")
    if errors.low > margins.error_rate:  # confidently more than the margin above control
        return out(
            "rollback",
            f"error rate {errors.canary.mean:.3%} vs control {errors.control.mean:.3%} (excess in "
            f"[{errors.low:.3%}, {errors.high:.3%}], allowed +{margins.error_rate:.1%})",
        )
    if slow.low > margins.slow_share:
        return out(
            "rollback",
            f"p99 latency {p99_k:.0f} ms vs control {p99_c:.0f} ms: {slow.canary.mean:.1%} of canary "
            f"requests slower than {slow_ms:.0f} ms ({cfg.max_p99_ratio}x + {cfg.p99_slack_ms:.0f} ms), "
            f"control {slow.control.mean:.1%} (excess in [{slow.low:.1%}, {slow.high:.1%}], "
            f"allowed +{margins.slow_share:.0%})",
        )
    if cfg.primary != "accepted_chars" and chars.high < -chars_margin:
        return out(
            "rollback",
            f"accepted chars per request fell: {chars.canary.mean:.3f} vs {chars.control.mean:.3f} "
            f"(delta in [{chars.low:.3f}, {chars.high:.3f}], allowed -{chars_margin:.3f})",
        )
    if primary.worse:
        return out(
            "rollback",
            f"{cfg.primary} fell: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
            f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f})",
        )
    last = step + 1 == len(cfg.steps)
    complete = step_canary_n >= cfg.min_samples
    # A step advances once it excludes, at advance_risk, a regression of detect_regression_sd sd in the primary and
    # in accepted characters per request (else a candidate that wins reward by showing less would reach more users
    # before the guardrail's alpha/6 test can roll it back).
    held = {cfg.primary: (primary, regression)}
    if cfg.primary != "accepted_chars":
        held["accepted_chars"] = (chars, cfg.detect_regression_sd * math.sqrt(pooled(chars.control, chars.canary).var))
    lows = {m: c.low_at(cfg.advance_risk) for m, (c, _) in held.items()}
    if complete and not last and all(lows[m] > -step_margin for m, (_, step_margin) in held.items()):
        return out(
            "advance",
            f"{' and '.join(held)} not worse than control by {cfg.detect_regression_sd} sd at risk {cfg.advance_risk:g} "
            f"after {step_canary_n} canary outcomes at {weight:.0%} ("
            + "; ".join(f"{m} delta >= {lows[m]:.4f}, allowed -{step_margin:.4f}" for m, (_, step_margin) in held.items())
            + ")",
        )
    unproven = [
        f"error rate excess {errors.high:.2%} > {margins.error_rate:.2%}" if errors.high > margins.error_rate else "",
        f"slow share excess {slow.high:.2%} > {margins.slow_share:.2%}" if slow.high > margins.slow_share else "",
        f"accepted chars delta >= {chars.low:.3f}, allowed -{chars_margin:.3f}"
        if cfg.primary != "accepted_chars" and chars.low < -chars_margin
        else "",
    ]
    unproven = [u for u in unproven if u]
    if complete and last and primary.better and not unproven:
        return out(
            "promote",
            f"{cfg.primary} rose: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
            f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f}); guardrails "
            f"non-inferior (accepted chars delta >= {chars.low:.3f}, allowed -{chars_margin:.3f})",
        )
    unmet = [
        f"{m} delta >= {lows[m]:.4f}, allowed -{step_margin:.4f}"
        for m, (_, step_margin) in held.items()
        if lows[m] <= -step_margin
    ]
    pending = f"{cfg.primary} delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f}" + (
        f"; not shown non-inferior: {'; '.join(unproven)}"
        if unproven and last
        else f"; step regression not excluded at risk {cfg.advance_risk:g}: {'; '.join(unmet)}"
        if unmet and not last
        else ""
    )
    if step_elapsed_s >= cfg.max_step_s:
        return out(
            "inconclusive",
            f"no decision within {cfg.max_step_s:.0f} s at {weight:.0%} ({step_canary_n} canary outcomes this step, {pending})",
        )
    ends = f"; inconclusive in {_duration(cfg.max_step_s - step_elapsed_s)} without a decision"
    if complete:
        return out("wait", f"undecided after {step_canary_n} canary outcomes at {weight:.0%} ({pending}){ends}")
    rate = step_canary_n / step_elapsed_s if step_elapsed_s > 0 else 0.0  # canary outcomes per second this step
    eta = f"; ~{_duration((cfg.min_samples - step_canary_n) / rate)} to {cfg.min_samples} at {rate:.2f}/s" if rate else ""
    return out("wait", f"{step_canary_n}/{cfg.min_samples} canary outcomes at {weight:.0%}{eta}{ends}")


def _duration(seconds: float) -> str:
    """A wait in the unit that reads best: 45 s, 12 min, 3.5 h."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class Ramp:
    """A ramp in progress: which step, since when, and every look so far (the audit's step table).

    The promote flow feeds it outcomes read from the logs; simulations feed it sampled outcomes.
    Only `advance` changes the step; `promote`, `rollback` and `inconclusive` end the ramp.
    """

    def __init__(self, cfg: CanaryConfig, now_s: float, margins: Margins | None = None):
        self.cfg, self.step, self.step_started_s, self.step_base_n = cfg, 0, now_s, 0
        self.margins = margins
        self.step_starts_ms: list[int] = []  # when each step after the first began (Outcome.time_ms clock)
        self.looks: list[Look] = []
        self._cols: Columns | None = None
        self._seen: tuple[int, Outcome | None] = (0, None)
        self._rebase_ms: int | None = None  # set by restart_step: the step's outcome count starts at this time

    @property
    def weight(self) -> float:
        return self.cfg.steps[self.step]

    def _columns(self, outcomes: Sequence[Outcome]) -> Columns:
        # An outcome list that only grew since the last look (as a simulation's does) is converted by its tail.
        n, last = self._seen
        if self._cols is not None and 0 < n <= len(outcomes) and outcomes[n - 1] is last:
            if n < len(outcomes):
                self._cols = self._cols.extend(Columns(outcomes[n:], self._cols.kinds))
        else:
            self._cols = Columns(outcomes)
        self._seen = (len(outcomes), outcomes[-1] if outcomes else None)
        return self._cols

    def observe(
        self,
        outcomes: Sequence[Outcome],
        health: dict[str, ArmHealth],
        now_s: float,
        probe_ok: bool = True,
        clock_ms: int | None = None,
    ) -> Look:
        """One look. clock_ms: now on Outcome.time_ms's clock (the step boundary if this look advances);
        default the latest outcome's time."""
        cols = self._columns(outcomes)
        n_canary = int(cols.canary.sum())
        if self._rebase_ms is not None:  # outcomes served while a human decided belong to the step before
            self.step_base_n, self._rebase_ms = int(np.count_nonzero(cols.canary & (cols.time_ms < self._rebase_ms))), None
        result = look(
            self.cfg,
            self.step,
            cols,
            n_canary - self.step_base_n,
            now_s - self.step_started_s,
            health,
            probe_ok,
            self.step_starts_ms,
            self.margins,
        )
        self.looks.append(result)
        if result.action == "advance":
            self.step, self.step_started_s, self.step_base_n = self.step + 1, now_s, n_canary
            self.step_starts_ms.append(clock_ms if clock_ms is not None else int(cols.time_ms.max(initial=0)) + 1)
        return result

    def restart_step(self, now_s: float, clock_ms: int) -> None:
        """The step just advanced to starts now: its traffic moved only after a human approved it. Its time limit,
        its stratum and its outcome count (outcomes after clock_ms) begin here, not at the look that asked."""
        self.step_started_s, self._rebase_ms = now_s, clock_ms
        if self.step_starts_ms:
            self.step_starts_ms[-1] = clock_ms
