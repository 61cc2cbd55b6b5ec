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
       p99 + p99_slack_ms, above control's share; the margin is the 1% a p99 allows), and the model's own
       (models[].canary.guardrails; by default accepted characters per request, a relative margin: a model
       that stops suggesting must not win)
    2. primary metric (models[].canary.primary, else canary.primary: reward per request by default):
       significantly lower → roll back
    3. a step that is not the last advances once it has >= min_samples canary outcomes and the primary and
       every model guardrail are each shown not worse than control by detect_regression_sd pooled
       standard deviations at level advance_risk: each step decides the regression it must catch before more
       users see the candidate (`plan()` sizes it by power). Advancing releases nothing, so it is tested at the
       exposure risk one accepts (the chance a candidate worse by that much reaches the next step, where it is
       tested again), not at alpha
    4. the last step promotes once the primary is significantly better AND every guardrail is shown
       non-inferior; "not significantly worse" is not enough
    5. a step past max_step_s, or past max_step_outcomes outcomes of both arms → inconclusive (never promoted):
       roll back, or ask a human (on_inconclusive='ask')

Error budget: the A/A false-alarm rate (a rollback for a regression, or a promotion, when both arms
serve the same weights) is at most alpha by a union bound: the primary test runs at alpha/2 and the
k + 2 statistical guardrails (the model's k, error rate, latency) at alpha/(2(k + 2)) each (alpha/6 with
the default's one); each is an always-valid mSPRT (release/stats.py), so looking after every batch costs nothing, and none
counts before both arms have min_test_samples outcomes. The latency guardrail is a test, not a
comparison of two sample p99s: a p99 of a few hundred outcomes is their second or third largest, and a
fresh engine's two slow requests would fail a candidate that is as fast as control everywhere else.
Watched metrics (models[].canary.watch; accept rate by default) are reported, not acted on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth, Columns, Outcome, blocks
from release.stats import Comparison, Summary, cuped, msprt, pooled, stratified_msprt
from tidal.model_settings import CanaryMetrics, Guardrail, Margins

Action = Literal["wait", "advance", "promote", "rollback", "inconclusive"]


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
    canary: np.ndarray,
    strata: tuple[np.ndarray, np.ndarray],
    alpha: float,
    covariate: np.ndarray | None = None,
) -> Comparison:
    """The stratified test of one metric on its CUPED-adjusted values; the arms' summaries reported are the raw ones.
    strata: (step served in, request kind) codes per outcome. Outcomes without a value (NaN: no score given) are
    left out of this metric's comparison."""
    known = ~np.isnan(values)
    if not known.all():
        values, canary, strata = values[known], canary[known], (strata[0][known], strata[1][known])
        covariate = None if covariate is None else covariate[known]
    tested = cuped(values, covariate) if cfg.cuped and covariate is not None else values
    c = stratified_msprt(
        name,
        blocks(tested, canary, *strata),
        alpha,
        cfg.mixture_sd,
        cfg.min_test_samples,
        min_stratum_n=10 if cfg.stratify else 2,
    )
    raw = [
        Summary(len(v), float(v.mean()) if len(v) else 0.0, float(v.var(ddof=1)) if len(v) > 1 else 0.0)
        for v in (values[~canary], values[canary])
    ]
    return replace(c, control=raw[0], canary=raw[1])


LABELS = {"accepted_chars": "accepted chars", "shown_chars": "shown chars", "thumbs_up": "thumbs-up rate"}
LABELS |= {"thumbs_down": "thumbs-down rate", "accepted": "accept rate"}


@dataclass(frozen=True)
class Guard:
    """One guardrail at one look: its comparison and its margin in the metric's units."""

    metric: str
    c: Comparison
    margin: float
    lower: bool  # lower is better (a rise is the regression)

    @property
    def label(self) -> str:
        return LABELS.get(self.metric, self.metric)

    def worse(self) -> bool:
        """Shown worse than control by more than the margin: roll back."""
        return self.c.low > self.margin if self.lower else self.c.high < -self.margin

    def unproven(self) -> str:
        """'' once shown non-inferior, else what is missing (promotion needs it)."""
        if self.lower:
            return f"{self.label} delta <= {self.c.high:.3f}, allowed +{self.margin:.3f}" if self.c.high > self.margin else ""
        return f"{self.label} delta >= {self.c.low:.3f}, allowed -{self.margin:.3f}" if self.c.low < -self.margin else ""

    def bound(self, risk: float) -> float:
        """The bound that must clear a step's regression, at `risk`: the upper for lower-is-better, else the lower."""
        return self.c.high_at(risk) if self.lower else self.c.low_at(risk)

    def clears(self, risk: float, step_margin: float) -> bool:
        return self.bound(risk) < step_margin if self.lower else self.bound(risk) > -step_margin

    def step_text(self, risk: float, step_margin: float) -> str:
        sign = ("<=", "+") if self.lower else (">=", "-")
        return f"{self.metric} delta {sign[0]} {self.bound(risk):.4f}, allowed {sign[1]}{step_margin:.4f}"


def tab_metrics(cfg: CanaryConfig, margins: Margins) -> CanaryMetrics:
    """The default canary of a model (models[].canary unset): cfg.primary, accepted characters per request guarded
    within margins.accepted_chars, the other Tab metrics watched."""
    guards = [] if cfg.primary == "accepted_chars" else [Guardrail(metric="accepted_chars", margin=margins.accepted_chars)]
    watch = [m for m in ("reward", "accepted", "accepted_chars") if m != cfg.primary]
    return CanaryMetrics(primary=cfg.primary, guardrails=guards, watch=watch)


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
    metrics: CanaryMetrics | None = None,
    step_n: int | None = None,
) -> Look:
    """Decide at one look. `outcomes`: both arms since the canary started; `step_canary_n`: canary outcomes
    collected since this step began; `step_starts_ms`: when each step after the first began (the clock of
    Outcome.time_ms), the strata of the ramp; `margins`: the model's, else cfg.margins; `metrics`: the model's
    primary and guardrails (models[].canary), else tab_metrics; `step_n`: outcomes of both arms since this step
    began (what cfg.max_step_outcomes bounds; default every outcome in `outcomes`)."""
    weight, margins = cfg.steps[step], margins or cfg.margins
    metrics = metrics or tab_metrics(cfg, margins)
    cols = outcomes if isinstance(outcomes, Columns) else Columns(outcomes)
    step_n = cols.n if step_n is None else step_n
    if cfg.stratify:
        strata = (np.searchsorted(np.asarray(step_starts_ms, np.int64), cols.time_ms, side="right"), cols.kind)
    else:
        strata = (np.zeros(cols.n, np.int64), np.zeros(cols.n, np.int64))
    # the primary has half the A/A budget; the guardrail tests (the model's, error rate, latency) share the other half
    guard_alpha = cfg.alpha / 2 / (2 + len(metrics.guardrails))
    name = metrics.primary
    comps = {
        m: _compare(cfg, m, cols.values[m], cols.canary, strata, cfg.alpha / 2 if m == name else guard_alpha, cols.history[m])
        for m in metrics.metrics()
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
    slow = _compare(cfg, "slow_share", (cols.latency_ms > slow_ms).astype(float), cols.canary, strata, guard_alpha)
    guards = [
        Guard(
            g.metric,
            comps[g.metric],
            g.margin * abs(comps[g.metric].control.mean) if g.relative else g.margin,
            g.lower_is_better,
        )
        for g in metrics.guardrails
    ]
    primary = comps[name]
    regression = cfg.detect_regression_sd * math.sqrt(pooled(primary.control, primary.canary).var)
    figures = {
        "n_control": int((~cols.canary).sum()),
        "n_canary": int(cols.canary.sum()),
        "step_canary_n": step_canary_n,
        "step_n": step_n,
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
                name: regression,
                **{g.metric: g.margin for g in guards},
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
    for g in guards:
        if g.worse():
            c = g.c
            return out(
                "rollback",
                f"{g.label} per request {'rose' if g.lower else 'fell'}: {c.canary.mean:.3f} vs {c.control.mean:.3f} "
                f"(delta in [{c.low:.3f}, {c.high:.3f}], allowed {'+' if g.lower else '-'}{g.margin:.3f})",
            )
    if primary.worse:
        return out(
            "rollback",
            f"{name} fell: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
            f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f})",
        )
    last = step + 1 == len(cfg.steps)
    complete = step_canary_n >= cfg.min_samples
    # A step advances once it excludes, at advance_risk, a regression of detect_regression_sd sd in the primary and
    # in every guardrail (else a candidate that wins reward by showing less would reach more users before the
    # guardrail's own test can roll it back).
    held = [(Guard(name, primary, regression, False), regression)] + [
        (g, cfg.detect_regression_sd * math.sqrt(pooled(g.c.control, g.c.canary).var)) for g in guards
    ]
    risk = cfg.advance_risk
    if complete and not last and all(g.clears(risk, m) for g, m in held):
        return out(
            "advance",
            f"{' and '.join(g.metric for g, _ in held)} not worse than control by {cfg.detect_regression_sd} sd at risk "
            f"{risk:g} after {step_canary_n} canary outcomes at {weight:.0%} ("
            + "; ".join(g.step_text(risk, m) for g, m in held)
            + ")",
        )
    unproven = [
        f"error rate excess {errors.high:.2%} > {margins.error_rate:.2%}" if errors.high > margins.error_rate else "",
        f"slow share excess {slow.high:.2%} > {margins.slow_share:.2%}" if slow.high > margins.slow_share else "",
        *(g.unproven() for g in guards),
    ]
    unproven = [u for u in unproven if u]
    if complete and last and primary.better and not unproven:
        shown = "; ".join(
            f"{g.label} delta {'<=' if g.lower else '>='} {g.c.high if g.lower else g.c.low:.3f}, allowed "
            f"{'+' if g.lower else '-'}{g.margin:.3f}"
            for g in guards
        )
        return out(
            "promote",
            f"{name} rose: {primary.canary.mean:.4f} vs {primary.control.mean:.4f} "
            f"(delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f}); guardrails "
            f"non-inferior ({shown or 'error rate and latency'})",
        )
    unmet = [g.step_text(risk, m) for g, m in held if not g.clears(risk, m)]
    pending = f"{name} delta in [{primary.low:.4f}, {primary.high:.4f}], p={primary.p_value:.4f}" + (
        f"; not shown non-inferior: {'; '.join(unproven)}"
        if unproven and last
        else f"; step regression not excluded at risk {risk:g}: {'; '.join(unmet)}"
        if unmet and not last
        else ""
    )
    if step_elapsed_s >= cfg.max_step_s:
        return out(
            "inconclusive",
            f"no decision within {cfg.max_step_s:.0f} s at {weight:.0%} ({step_canary_n} canary outcomes this step, {pending})",
        )
    bound = cfg.max_step_outcomes
    if bound is not None and step_n >= bound:
        return out(
            "inconclusive",
            f"no decision within {bound} outcomes at {weight:.0%} ({step_canary_n} canary outcomes this step, "
            f"{step_elapsed_s:.0f} s, {pending})",
        )
    more = f" or {bound - step_n} more outcomes" if bound is not None else ""
    ends = f"; inconclusive in {_duration(cfg.max_step_s - step_elapsed_s)}{more} without a decision"
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

    def __init__(self, cfg: CanaryConfig, now_s: float, margins: Margins | None = None, metrics: CanaryMetrics | None = None):
        self.cfg, self.step, self.step_started_s, self.step_base_n = cfg, 0, now_s, 0
        self.step_base_all = 0  # outcomes of both arms before this step (step_base_n: the canary's)
        self.margins, self.metrics = margins, metrics
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
            before = cols.time_ms < self._rebase_ms
            self.step_base_n = int(np.count_nonzero(cols.canary & before))
            self.step_base_all, self._rebase_ms = int(np.count_nonzero(before)), None
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
            self.metrics,
            cols.n - self.step_base_all,
        )
        self.looks.append(result)
        if result.action == "advance":
            self.step, self.step_started_s, self.step_base_n = self.step + 1, now_s, n_canary
            self.step_base_all = cols.n
            self.step_starts_ms.append(clock_ms if clock_ms is not None else int(cols.time_ms.max(initial=0)) + 1)
        return result

    def restart_step(self, now_s: float, clock_ms: int) -> None:
        """The step just advanced to starts now: its traffic moved only after a human approved it. Its time limit,
        its stratum and its outcome counts (outcomes after clock_ms) begin here, not at the look that asked."""
        self.step_started_s, self._rebase_ms = now_s, clock_ms
        if self.step_starts_ms:
            self.step_starts_ms[-1] = clock_ms
