"""Always-valid comparison of a canary arm with the control arm: the mixture sequential probability
ratio test (mSPRT) and its confidence sequence, safe to evaluate after every batch of outcomes.

Source: Johari, Koomen, Pekelis, Walsh, "Peeking at A/B Tests: Why it matters, and what to do about
it" (KDD 2017) and "Always Valid Inference: Continuous Monitoring of A/B Tests" (Operations Research
2022), two-sample normal case with a N(0, tau^2) mixture over the effect theta = mean_B - mean_A:

    theta_hat = ybar_B - ybar_A,          V = s^2 (1 / n_A + 1 / n_B)          (variance of theta_hat)
    Lambda_n  = sqrt(V / (V + tau^2)) * exp( tau^2 theta_hat^2 / (2 V (V + tau^2)) )

Under theta = 0, Lambda_n is a non-negative martingale with mean 1, so by Ville's inequality
P(Lambda_n >= 1/alpha for some n) <= alpha: rejecting the first time Lambda_n >= 1/alpha keeps the
type-I error at alpha however often one looks. The always-valid p-value is min over looks of
1/Lambda_n. Inverting the test gives the confidence sequence

    theta in theta_hat +- sqrt( 2 V (V + tau^2) / tau^2 * ( log(1/alpha) + 0.5 log((V + tau^2) / V) ) )

s^2 is the pooled variance of both arms, i.e. the variance under H0 (the normal approximation of the
paper). Per-arm variances are not used: a canary with a handful of identical outcomes (variance 0)
would otherwise make any gap look certain. Below `min_n` outcomes per arm no test is made at all.
tau is set per metric as `mixture_sd` times the pooled standard deviation: the effect size the test
is most sensitive to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Below this variance an arm is treated as (nearly) constant; keeps V > 0 for all-equal outcomes.
_VAR_FLOOR = 1e-9


@dataclass(frozen=True)
class Summary:
    """Count, mean and (unbiased) variance of one arm's outcomes of one metric."""

    n: int
    mean: float
    var: float

    @classmethod
    def of_rate(cls, hits: int, n: int) -> Summary:
        """A 0/1 outcome given as a count: mean hits/n, unbiased variance of the indicators."""
        if n == 0:
            return cls(0, 0.0, 0.0)
        p = hits / n
        return cls(n, p, p * (1 - p) * n / (n - 1) if n > 1 else 0.0)

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        n = len(values)
        if n == 0:
            return cls(0, 0.0, 0.0)
        mean = math.fsum(values) / n
        var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
        return cls(n, mean, var)


@dataclass(frozen=True)
class Comparison:
    """One look at one metric: canary minus control, with its always-valid bounds."""

    metric: str
    control: Summary
    canary: Summary
    delta: float  # theta_hat = canary mean - control mean
    low: float  # confidence-sequence bounds on delta at level alpha
    high: float
    log_lambda: float  # log of the mixture likelihood ratio
    p_value: float  # 1 / Lambda at this look (take the running minimum across looks)
    alpha: float
    var: float = math.inf  # V, the variance of delta (inf: no test made yet)
    tau2: float = 1.0  # the mixture's tau^2

    def low_at(self, alpha: float) -> float:
        """The confidence sequence's lower bound at another level (same estimate, variance and mixture)."""
        if math.isinf(self.var):
            return -math.inf
        return self.delta - _half_width(self.var, self.tau2, alpha)

    def high_at(self, alpha: float) -> float:
        """The confidence sequence's upper bound at another level."""
        if math.isinf(self.var):
            return math.inf
        return self.delta + _half_width(self.var, self.tau2, alpha)

    @property
    def significant(self) -> bool:
        return self.log_lambda >= math.log(1.0 / self.alpha)

    @property
    def worse(self) -> bool:
        """Canary significantly below control."""
        return self.significant and self.delta < 0

    @property
    def better(self) -> bool:
        return self.significant and self.delta > 0

    @property
    def relative(self) -> float | None:
        return None if self.control.mean == 0 else self.delta / abs(self.control.mean)

    def row(self) -> dict:
        return {
            "metric": self.metric,
            "control": round(self.control.mean, 5),
            "canary": round(self.canary.mean, 5),
            "n_control": self.control.n,
            "n_canary": self.canary.n,
            "delta": round(self.delta, 5),
            "low": round(self.low, 5),
            "high": round(self.high, 5),
            "p_value": round(self.p_value, 5),
        }


def _half_width(V: float, tau2: float, alpha: float) -> float:
    """Half-width of the confidence sequence at level alpha (module docstring)."""
    return math.sqrt(2 * V * (V + tau2) / tau2 * (math.log(1 / alpha) + 0.5 * math.log((V + tau2) / V)))


def _test(
    metric: str, control: Summary, canary: Summary, delta: float, V: float, pooled_var: float, alpha: float, mixture_sd: float
) -> Comparison:
    """The mSPRT of an estimate `delta` with variance `V` (module docstring); tau^2 = mixture_sd^2 * pooled_var."""
    V = max(V, _VAR_FLOOR)
    tau2 = mixture_sd**2 * max(pooled_var, _VAR_FLOOR)
    log_lambda = 0.5 * math.log(V / (V + tau2)) + tau2 * delta**2 / (2 * V * (V + tau2))
    half = _half_width(V, tau2, alpha)
    p_value = min(1.0, math.exp(-log_lambda))
    return Comparison(metric, control, canary, delta, delta - half, delta + half, log_lambda, p_value, alpha, V, tau2)


def _check(alpha: float, mixture_sd: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), not {alpha}")
    if mixture_sd <= 0:
        raise ValueError(f"mixture_sd must be > 0, not {mixture_sd}")


def pooled(control: Summary, canary: Summary) -> Summary:
    """Both arms as one sample: its variance is the variance under H0 (within-arm plus between-arm parts)."""
    return _merge([control, canary])


def msprt(metric: str, control: Summary, canary: Summary, alpha: float, mixture_sd: float, min_n: int = 30) -> Comparison:
    """The mSPRT of H0: equal means, at level alpha, after the outcomes summarised so far (no evidence, and
    infinite bounds, until both arms have min_n outcomes)."""
    _check(alpha, mixture_sd)
    delta = canary.mean - control.mean
    if control.n < max(min_n, 2) or canary.n < max(min_n, 2):
        return Comparison(metric, control, canary, delta, -math.inf, math.inf, 0.0, 1.0, alpha)
    var = pooled(control, canary).var
    return _test(metric, control, canary, delta, var * (1.0 / control.n + 1.0 / canary.n), var, alpha, mixture_sd)


Pair = tuple[Summary, Summary]  # (control, canary) of one stratum


def stratified_msprt(
    metric: str, blocks: Sequence[Sequence[Pair]], alpha: float, mixture_sd: float, min_n: int = 30, min_stratum_n: int = 2
) -> Comparison:
    """The mSPRT of H0: equal means in every stratum. Strata come in blocks (the ramp's steps), each holding
    strata of its own (request kinds):

      * within a block, kinds are weighted by their share of its outcomes (post-stratification): the block's
        estimate is the average effect over the traffic's mix of kinds, even when a change helps one kind more
        than another, and the spread between kinds no longer counts as noise;
            delta_b = sum_s w_s delta_s,   V_b = sum_s w_s^2 V_s,   w_s = n_s / n_b
      * blocks are combined by precision (Cochran): the same candidate is measured in each period, and a
        period in which the canary had few requests says less;
            delta = sum_b delta_b / V_b / sum_b 1 / V_b,   V = 1 / sum_b 1 / V_b
      with V_s = s_s^2 (1 / n_control,s + 1 / n_canary,s), s_s^2 pooled within stratum s (under H0).

    Pooling everything instead adds the between-kinds spread to the noise, and biases the difference by any
    trend over time, since the canary's share of requests grows during the ramp (Simpson's paradox). The
    statistic is a sum of independent per-outcome terms with weights fixed by counts (and variances), so the
    normal-mixture martingale of `msprt` applies to it. A stratum with fewer than min_stratum_n outcomes in an
    arm is left out until it has them. tau is in units of the overall pooled standard deviation, as in `msprt`.
    `control`/`canary` of the result summarise all outcomes (for reports); delta and its bounds are stratified."""
    _check(alpha, mixture_sd)
    pairs = [pair for block in blocks for pair in block]
    control = _merge([c for c, _ in pairs])
    canary = _merge([k for _, k in pairs])
    floor = max(min_stratum_n, 2)
    precision, score = 0.0, 0.0
    for block in blocks:
        used = [(c, k) for c, k in block if c.n >= floor and k.n >= floor]
        size = sum(c.n + k.n for c, k in used)
        if not used:
            continue
        delta_b = sum((c.n + k.n) / size * (k.mean - c.mean) for c, k in used)
        v_b = sum(((c.n + k.n) / size) ** 2 * max(pooled(c, k).var, _VAR_FLOOR) * (1.0 / c.n + 1.0 / k.n) for c, k in used)
        precision += 1.0 / v_b
        score += delta_b / v_b
    if control.n < max(min_n, 2) or canary.n < max(min_n, 2) or precision == 0:
        return Comparison(metric, control, canary, canary.mean - control.mean, -math.inf, math.inf, 0.0, 1.0, alpha)
    return _test(metric, control, canary, score / precision, 1.0 / precision, pooled(control, canary).var, alpha, mixture_sd)


def _merge(parts: Sequence[Summary]) -> Summary:
    """One summary of several samples (exact: counts, means and sums of squares add up)."""
    n = sum(p.n for p in parts)
    if n == 0:
        return Summary(0, 0.0, 0.0)
    mean = math.fsum(p.n * p.mean for p in parts) / n
    ss = math.fsum(max(p.n - 1, 0) * p.var + p.n * (p.mean - mean) ** 2 for p in parts)
    return Summary(n, mean, ss / (n - 1) if n > 1 else 0.0)


def cuped(values: Sequence[float] | np.ndarray, covariates: Sequence[float] | np.ndarray) -> np.ndarray:
    """Values adjusted by a covariate measured before the experiment (CUPED: Deng, Xu, Kohavi, Walker,
    "Improving the Sensitivity of Online Controlled Experiments by Utilizing Pre-Experiment Data", WSDM 2013):

        y' = y - theta (x - mean(x)),   theta = cov(x, y) / var(x), over both arms together

    x cannot depend on the arm (it was fixed before the ramp), so y' has the arms' difference of y and a
    variance smaller by the share of y's variance that x explains. theta comes from the data; with it
    estimated from both arms alike the adjusted difference stays consistent, and the always-valid property
    carries over asymptotically (Lindon, Ham, Tingley, Malek, "Anytime-Valid Linear Models and Regression
    Adjusted Causal Inference in Randomized Experiments", 2022). Missing covariates (NaN: a user with no
    history) are set to the mean, i.e. their values are left as they are. Fewer than 3 known covariates, or
    a constant one: the values unchanged."""
    y = np.asarray(values, dtype=float)
    x = np.asarray(covariates, dtype=float)
    known = ~np.isnan(x)
    if known.sum() < 3:
        return y.copy()
    xk, yk = x[known], y[known]
    dx = xk - xk.mean()
    vx = float(dx @ dx)
    if vx <= _VAR_FLOOR:
        return y.copy()
    theta = float(dx @ (yk - yk.mean())) / vx
    out = y.copy()
    out[known] = yk - theta * dx
    return out


@dataclass(frozen=True)
class StepPlan:
    """What one canary step needs, from the test's boundary (a power calculation in requests, both arms)."""

    weight: float  # the canary's share of requests
    effect_sd: float  # the regression the step must decide, in pooled standard deviations of the metric
    detect_requests: int  # requests until a regression of effect_sd is rolled back with probability >= power
    clear_requests: int  # requests until an unchanged canary is shown not to regress by effect_sd (median)

    @property
    def detect_canary(self) -> int:
        return math.ceil(self.weight * self.detect_requests)


def _half_width_sd(n: float, weight: float, alpha: float, mixture_sd: float) -> tuple[float, float]:
    """(sqrt(V), half-width of the confidence sequence) in pooled standard deviations after n requests."""
    v = 1.0 / (n * weight * (1 - weight))  # V / s^2 with n_canary = weight n, n_control = (1 - weight) n
    t2 = mixture_sd**2
    return math.sqrt(v), _half_width(v, t2, alpha)


def _smallest_n(ok) -> int:
    hi = 16
    while not ok(hi):
        hi *= 2
        if hi > 10**12:
            raise ValueError("no sample size reaches the target")
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def plan_step(
    weight: float, effect_sd: float, alpha: float, mixture_sd: float, power: float = 0.8, clear_alpha: float | None = None
) -> StepPlan:
    """The requests a step at `weight` needs to decide a regression of `effect_sd` pooled standard deviations:

    * detect: the estimate z = delta / sqrt(V) is N(effect_sd / sqrt(V / s^2), 1); the test has rejected once
      |z| >= its boundary, i.e. once the half-width falls below |delta|. Counting only the final look
      (a sequential test may also stop earlier), the smallest n with P(upper bound < 0) >= power.
    * clear: the smallest n whose half-width at level clear_alpha (default alpha: the level the step advances
      at) is below effect_sd, so that an unchanged canary's lower bound passes -effect_sd in about half the
      runs: when the step can advance.
    Both ignore variance reduction (stratification, CUPED), which only shortens them."""
    clear_alpha = alpha if clear_alpha is None else clear_alpha
    _check(alpha, mixture_sd)
    _check(clear_alpha, mixture_sd)
    if not 0 < weight < 1 or effect_sd <= 0 or not 0 < power < 1:
        raise ValueError(f"need weight in (0, 1), effect_sd > 0, power in (0, 1): {weight}, {effect_sd}, {power}")

    def detects(n: int) -> bool:
        sd, half = _half_width_sd(n, weight, alpha, mixture_sd)
        return _normal_cdf((effect_sd - half) / sd) >= power

    def clears(n: int) -> bool:
        return _half_width_sd(n, weight, clear_alpha, mixture_sd)[1] <= effect_sd

    return StepPlan(weight, effect_sd, _smallest_n(detects), _smallest_n(clears))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def fit_mixture_sd(effects: Sequence[tuple[float, float]], floor: float = 0.05) -> float:
    """The N(0, tau^2) mixture fitted to effects seen before: `effects` are (delta, V) of past canaries, each in
    pooled standard deviations (delta / s, V / s^2). Each delta ~ N(0, tau^2 + V) under the prior, so the
    method-of-moments fit is tau^2 = mean(delta^2 - V); at least `floor` (no effect seen yet still leaves the
    test some width to look for one). Johari et al. recommend matching tau to the effects one expects."""
    if not effects:
        raise ValueError("fit_mixture_sd needs at least one past effect")
    tau2 = math.fsum(d * d - v for d, v in effects) / len(effects)
    return max(math.sqrt(max(tau2, 0.0)), floor)
