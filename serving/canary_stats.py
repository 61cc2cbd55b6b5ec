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
        return {"metric": self.metric, "control": round(self.control.mean, 5), "canary": round(self.canary.mean, 5),
                "n_control": self.control.n, "n_canary": self.canary.n, "delta": round(self.delta, 5),
                "low": round(self.low, 5), "high": round(self.high, 5), "p_value": round(self.p_value, 5)}


def msprt(metric: str, control: Summary, canary: Summary, alpha: float, mixture_sd: float, min_n: int = 30) -> Comparison:
    """The mSPRT of H0: equal means, at level alpha, after the outcomes summarised so far (no evidence, and
    infinite bounds, until both arms have min_n outcomes)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), not {alpha}")
    if mixture_sd <= 0:
        raise ValueError(f"mixture_sd must be > 0, not {mixture_sd}")
    delta = canary.mean - control.mean
    if control.n < max(min_n, 2) or canary.n < max(min_n, 2):
        return Comparison(metric, control, canary, delta, -math.inf, math.inf, 0.0, 1.0, alpha)
    n = control.n + canary.n
    # pooled variance under H0: within-arm sums of squares plus the between-arm part
    pooled_var = ((control.n - 1) * control.var + (canary.n - 1) * canary.var
                  + control.n * canary.n / n * delta**2) / (n - 1)
    pooled_var = max(pooled_var, _VAR_FLOOR)
    V = pooled_var * (1.0 / control.n + 1.0 / canary.n)
    tau2 = mixture_sd**2 * pooled_var
    log_lambda = 0.5 * math.log(V / (V + tau2)) + tau2 * delta**2 / (2 * V * (V + tau2))
    half = math.sqrt(2 * V * (V + tau2) / tau2 * (math.log(1 / alpha) + 0.5 * math.log((V + tau2) / V)))
    p_value = min(1.0, math.exp(-log_lambda))
    return Comparison(metric, control, canary, delta, delta - half, delta + half, log_lambda, p_value, alpha)
