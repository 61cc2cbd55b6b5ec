"""Canary ramp: how fast a 20% accept-rate regression is caught, how many users it reaches, how fast a
20% improvement is promoted, that a candidate better on reward but worse on accepted characters is never
promoted, and the A/A false-alarm rate, all on simulated traffic.

    .venv/bin/python bench/canary.py [--ramps 200] [--rate-rps 20] [--seed 0] [--max-step-s S] [--jobs 2]
                                     [--users 4000] [--user-spread 0.5] [--kinds 2] [--plain] [--no-adjust]

What is measured: --ramps seeded ramps per scenario (release/ramp_simulation.py: the production `Ramp` and
`look()` on simulated outcomes), control accepting 30% of suggestions (reward per request 0.05 under the
default rule, 24 characters a suggestion):
  * regression: accept rate 20% lower (0.24). A ramp "detects" it when it ends in a rollback, for any
    reason. Reported over the detecting ramps: median and p90 requests (both arms) and simulated seconds
    until the rollback, the median exposed share (canary requests / all requests until then), the step.
  * improvement: accept rate 20% higher (0.36): share promoted, median requests until the promotion.
  * chars_trap: 10% more accepts (0.33, reward +0.03 per request) of suggestions 27% shorter (17.5
    characters), so accepted characters per request fall 20%: share promoted (must be 0) and how it ended.
  * A/A: both arms 0.30: the share ending in a rollback or a promotion (the false-alarm rate the policy
    bounds by alpha).
Also printed: the power calculation of the first step (`CanaryConfig.plan()`), and the fewest requests
any level-alpha/2 test needs for a median detection of the regression at the first step's weight
(fixed-horizon z-test, no sequential penalty: (z_{1-alpha/2} / d)^2 canary outcomes, d the effect in
standard deviations), the floor under detect_requests_median at that exposure.

Population (release/ramp_simulation.Population): --users users (4,000) whose accept probability varies by a
Gamma factor with coefficient of variation --user-spread (0.5), --kinds request kinds (2: half at 0.5x the
accept rate, half at 1.5x), and the outcomes each user had in the hour before the ramp (canary.history_s
at the same traffic: Poisson(rate x 3600 / users) per user), which CUPED uses. These are assumptions, not
measurements of a real deployment; --plain runs homogeneous users, one kind, no history (the policy's
adjustments then have nothing to remove); --no-adjust runs the policy without stratification and CUPED.
Users stick to their arm, so a heterogeneous population clusters each arm's outcomes by user: the A/A
scenario checks that the error bound survives that. `variance_ratio` measures the gain on one sample
of 40,000 A/A requests at 50%: the stratified CUPED estimate's variance over the plain difference's, for
reward (from the confidence sequences' half-widths).

Assumptions: the production CanaryConfig except max_step_s (default 1800 s, as production). Traffic is
--rate-rps requests/s (20 by default: an assumed small deployment), looks come every poll_s (5 s) =
poll_s * rate requests, every request is resolved by the next look (real feedback arrives later, so real
seconds are longer by up to feedback_wait_s). Seeds are shared between scenarios (same users and
arrivals). Ramps run in --jobs processes (results do not depend on it: each ramp is seeded by its index);
~20 minutes on 2 cores, most of it the A/A ramps, which run every step to max_step_s (--scenarios picks some).
Progress goes to stderr; the last stdout line is one JSON object. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from release.canary_config import CanaryConfig
from release.policy import look
from release.ramp_simulation import ArmModel, Population, RampResult, run_ramp, sample

P_CONTROL, RELATIVE_CHANGE = 0.30, 0.20
SCENARIOS = {  # name: the canary's arm (control is ArmModel(P_CONTROL))
    "regression": ArmModel(P_CONTROL * (1 - RELATIVE_CHANGE)),
    "improvement": ArmModel(P_CONTROL * (1 + RELATIVE_CHANGE)),
    "chars_trap": ArmModel(0.33, mean_chars=17.45),  # 0.33 x 17.45 = 0.8 x (0.30 x 24) accepted chars per request
    "aa": ArmModel(P_CONTROL),
}


def run_many(
    label: str, cfg: CanaryConfig, canary: ArmModel, args: argparse.Namespace, look_every: int, population: Population
) -> list[RampResult]:
    one = partial(
        run_ramp,
        cfg,
        (ArmModel(P_CONTROL), canary),
        rate_rps=args.rate_rps,
        look_every=look_every,
        max_requests=10**7,
        users=args.users,
        population=population,
    )
    out: list[RampResult] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(one, range(args.seed, args.seed + args.ramps), chunksize=5):
            out.append(result)
            if len(out) % 25 == 0 or len(out) == args.ramps:
                print(
                    f"[canary] {label}: {len(out)}/{args.ramps} ramps, {dict(Counter(r.action for r in out))}",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def p90(values: list[float]) -> float | None:
    return float(np.quantile(values, 0.9)) if values else None


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def fixed_horizon_floor(weight: float, alpha: float) -> tuple[float, int]:
    """(effect in sd, requests) a fixed-horizon one-sided z-test at alpha needs for a median detection of the
    regression at `weight`: z_{1-alpha} / d standard errors, i.e. n_canary = (z / d)^2 (control's arm infinite)."""
    sd = math.sqrt(P_CONTROL * (1 - P_CONTROL))  # reward = accepted - 0.25 under the default rule: same sd
    d = P_CONTROL * RELATIVE_CHANGE / sd
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return d, math.ceil((z / d) ** 2 / weight)


def variance_ratio(cfg: CanaryConfig, population: Population, users: int, seed: int) -> float:
    """Var(stratified, CUPED-adjusted difference) / Var(plain difference) of reward on one A/A sample."""
    outcomes = sample((ArmModel(P_CONTROL), ArmModel(P_CONTROL)), 0.5, 40_000, seed, users=users, population=population)
    half = {}
    for adjust in (False, True):
        c = cfg.model_copy(update={"stratify": adjust, "cuped": adjust})
        reward = look(c, len(c.steps) - 1, outcomes, 0, 0.0, {}).comparisons["reward"]
        half[adjust] = reward.high - reward.delta
    return (half[True] / half[False]) ** 2


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ramps", type=int, default=200, help="ramps per scenario")
    ap.add_argument("--rate-rps", type=float, default=20.0, help="assumed requests/s to the model, both arms")
    ap.add_argument("--seed", type=int, default=0, help="first seed; ramp i uses seed + i")
    ap.add_argument("--max-step-s", type=float, default=None, help="default: the production CanaryConfig's")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--user-spread", type=float, default=0.5, help="coefficient of variation of users' accept factor")
    ap.add_argument("--users", type=int, default=4000, help="users sending the traffic (each sticks to one arm)")
    ap.add_argument("--kinds", type=int, default=2, choices=(1, 2), help="request kinds (2: accept factors 0.5 and 1.5)")
    ap.add_argument("--plain", action="store_true", help="homogeneous users, one kind, no history")
    ap.add_argument("--no-adjust", action="store_true", help="the policy without stratification and CUPED")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a CanaryConfig field, e.g. --set mixture_sd=0.13 --set 'steps=[0.05, 0.5]'",
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ",".join(SCENARIOS))
    args = ap.parse_args(argv)
    base = CanaryConfig()
    update: dict = {"max_step_s": args.max_step_s} if args.max_step_s else {}
    if args.no_adjust:
        update |= {"stratify": False, "cuped": False}
    for item in args.set:
        name, _, value = item.partition("=")
        update[name] = json.loads(value)
    cfg = CanaryConfig.model_validate(base.model_dump() | update)
    population = (
        Population()
        if args.plain
        else Population(
            user_spread=args.user_spread,
            history_requests=args.rate_rps * cfg.history_s / args.users,
            kinds=(("line_start", 0.5, 0.5), ("mid_line", 0.5, 1.5)) if args.kinds == 2 else (("", 1.0, 1.0),),
        )
    )
    look_every = max(1, round(cfg.poll_s * args.rate_rps))
    t0 = time.perf_counter()
    runs = {name: run_many(name, cfg, SCENARIOS[name], args, look_every, population) for name in args.scenarios.split(",")}

    result: dict = {"bench": "canary"}
    if "regression" in runs:
        hits = [r for r in runs["regression"] if r.action == "rollback"]
        result |= {
            "detect_requests_median": median([r.requests for r in hits]),
            "detect_requests_p90": p90([r.requests for r in hits]),
            "detect_s_median": median([r.seconds for r in hits]),
            "exposed_share": rounded(median([r.exposed_share for r in hits])),
            "exposed_share_p90": rounded(p90([r.exposed_share for r in hits])),
            "detection_rate": len(hits) / len(runs["regression"]),
            "detect_step_median": median([r.step for r in hits]),
            "detect_steps": {str(k): v for k, v in sorted(Counter(r.step for r in hits).items())},
            "detect_canary_requests_median": median([r.canary_requests for r in hits]),
            "detect_reasons": dict(Counter(r.reason.split(":")[0].split(" ")[0] for r in hits)),
            "regression_outcomes": dict(Counter(r.action for r in runs["regression"])),
        }
    if "improvement" in runs:
        won = [r for r in runs["improvement"] if r.action == "promote"]
        result |= {
            "promote_requests_median": median([r.requests for r in won]),
            "promote_requests_p90": p90([r.requests for r in won]),
            "promotion_rate": len(won) / len(runs["improvement"]),
            "improvement_outcomes": dict(Counter(r.action for r in runs["improvement"])),
        }
    if "chars_trap" in runs:
        trap = runs["chars_trap"]
        result |= {
            "chars_trap_promoted": sum(r.action == "promote" for r in trap),
            "chars_trap_outcomes": dict(Counter(r.action for r in trap)),
            "chars_trap_reasons": dict(Counter(r.reason.split(":")[0].split(" (")[0] for r in trap)),
            "chars_trap_requests_median": median([r.requests for r in trap]),
        }
    if "aa" in runs:
        aa_n = Counter(r.action for r in runs["aa"])
        n = len(runs["aa"])
        result |= {
            "aa_false_alarm_rate": (aa_n["rollback"] + aa_n["promote"]) / n,
            "aa_false_rollback_rate": aa_n["rollback"] / n,
            "aa_false_promotion_rate": aa_n["promote"] / n,
            "aa_inconclusive_rate": aa_n["inconclusive"] / n,
        }
    result["variance_ratio"] = round(variance_ratio(cfg, population, args.users, args.seed), 4)
    plan = cfg.plan()[0]
    d, floor = fixed_horizon_floor(cfg.steps[0], cfg.alpha / 2)
    result |= {
        "plan_step1": {
            "weight": plan.weight,
            "detect_requests_power80": plan.detect_requests,
            "clear_requests_median": plan.clear_requests,
        },
        "regression_effect_sd": round(d, 4),
        "detect_requests_floor_fixed_horizon": floor,
        "ramps": args.ramps,
        "rate_rps": args.rate_rps,
        "seed": args.seed,
        "p_control": P_CONTROL,
        "relative_change": RELATIVE_CHANGE,
        "steps": cfg.steps,
        "min_samples": cfg.min_samples,
        "alpha": cfg.alpha,
        "mixture_sd": cfg.mixture_sd,
        "detect_regression_sd": cfg.detect_regression_sd,
        "advance_risk": cfg.advance_risk,
        "max_step_s": cfg.max_step_s,
        "stratify": cfg.stratify,
        "cuped": cfg.cuped,
        "population": dataclasses.asdict(population),
        "look_every_requests": look_every,
        "jobs": args.jobs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
