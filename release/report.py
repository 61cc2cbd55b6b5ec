"""The record a canary leaves: for every step, the outcomes per arm, each metric's always-valid interval with
the margin it was judged against, and the decision's reason. The promote flow stores it beside the release
(`canary_key`); the flywheel's cycle report and the demo print it."""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from release.policy import Action, Look


class MetricInterval(BaseModel):
    """One metric at one look: each arm's mean, canary − control with its always-valid bounds (None: not yet
    tested, too few outcomes), and the margin the decision used (None: none)."""

    metric: str = Field(description="reward, accepted, accepted_chars, error_rate or slow_share.")
    control: float = Field(description="Control's mean (raw, before any adjustment).")
    canary: float = Field(description="Canary's mean (raw).")
    delta: float = Field(description="Estimated canary − control (stratified and CUPED-adjusted where the policy is).")
    low: float | None = Field(description="Lower always-valid bound of delta at the metric's level.")
    high: float | None = Field(description="Upper always-valid bound of delta.")
    margin: float | None = Field(None, description="Margin in the metric's units (see Look.margins).")


class CanaryStep(BaseModel):
    """The look that ended a step (advance, promote, rollback, inconclusive), or the last look of an unfinished one."""

    step: int = Field(ge=1, description="1-based step number.")
    weight: float = Field(gt=0, lt=1, description="Canary traffic share of the step.")
    action: Action
    reason: str
    n_control: int = Field(ge=0, description="Control outcomes since the canary started.")
    n_canary: int = Field(ge=0, description="Canary outcomes since the canary started.")
    step_canary_n: int = Field(ge=0, description="Canary outcomes in this step.")
    step_n: int | None = Field(
        None, ge=0, description="Outcomes of both arms in this step (what canary.max_step_outcomes bounds); None before it."
    )
    step_elapsed_s: float = Field(ge=0, description="Seconds the step had run at this look.")
    metrics: list[MetricInterval]


class CanaryRecord(BaseModel):
    """A whole canary: which versions, and the table of its steps."""

    model: str
    control: int = Field(description="Champion version (control arm).")
    canary: int = Field(description="Candidate version (canary arm).")
    steps: list[CanaryStep]


def _finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 6)


def step_record(lk: Look) -> CanaryStep:
    return CanaryStep(
        step=lk.step + 1,
        weight=lk.weight,
        action=lk.action,
        reason=lk.reason,
        n_control=int(lk.figures.get("n_control", 0)),
        n_canary=int(lk.figures.get("n_canary", 0)),
        step_canary_n=int(lk.figures.get("step_canary_n", 0)),
        step_n=int(lk.figures["step_n"]) if "step_n" in lk.figures else None,
        step_elapsed_s=float(lk.figures.get("step_elapsed_s", 0.0)),
        metrics=[
            MetricInterval(
                metric=name,
                control=round(c.control.mean, 6),
                canary=round(c.canary.mean, 6),
                delta=round(c.delta, 6),
                low=_finite(c.low),
                high=_finite(c.high),
                margin=lk.margins.get(name),
            )
            for name, c in lk.comparisons.items()
        ],
    )


def canary_record(model: str, control: int, canary: int, looks: list[Look]) -> CanaryRecord:
    """The step-ending looks of a ramp (the last look too, if it ended nothing)."""
    ending = [lk for lk in looks if lk.action != "wait"]
    if looks and looks[-1].action == "wait":
        ending.append(looks[-1])
    return CanaryRecord(model=model, control=control, canary=canary, steps=[step_record(lk) for lk in ending])


def canary_key(model: str, version: int) -> str:
    return f"releases/model={model}/v{version}/canary.json"


def step_table(record: CanaryRecord, indent: str = "") -> str:
    """The steps as text: one line per step, one per metric with its interval and margin."""
    lines = []
    for s in record.steps:
        lines.append(
            f"{indent}step {s.step} at {s.weight:.0%}: {s.action} after {s.step_elapsed_s:.0f} s "
            f"({s.n_control} control / {s.n_canary} canary outcomes, {s.step_canary_n} canary"
            + ("" if s.step_n is None else f" of {s.step_n}")
            + f" this step): {s.reason}"
        )
        for m in s.metrics:
            bounds = "not tested yet" if m.low is None else f"delta {m.delta:+.4f} in [{m.low:+.4f}, {m.high:+.4f}]"
            margin = "" if m.margin is None else f", margin {m.margin:.4f}"
            lines.append(f"{indent}    {m.metric:<15} control {m.control:.4f}  canary {m.canary:.4f}  {bounds}{margin}")
    return "\n".join(lines)
