"""Canary ramp: how fast a 20% accept-rate regression is caught, how many users it reaches, and the A/A
false-alarm rate, all on simulated traffic.

    .venv/bin/python bench/canary.py [--ramps 200] [--rate-rps 20] [--seed 0] [--max-step-s S] [--jobs 2]

What is measured: --ramps seeded ramps (sim/canary_outcomes.py, the production `Ramp` and `look()` on
simulated outcomes) with a canary whose accept rate is 20% lower (0.30 -> 0.24, reward per request
0.05 -> -0.01 under the default rule), and --ramps A/A ramps (both arms 0.30). A ramp "detects" the
regression when it ends in a rollback, for any reason. Reported over the detecting ramps: the median
requests (both arms) and simulated seconds until the rollback, the median exposed share (canary
requests / all requests until then) and the step reached; over the A/A ramps: the share ending in a
rollback or a promotion (the false-alarm rate the policy bounds by alpha).

Assumptions: the production CanaryConfig (steps 5/25/50%, min_samples 200, alpha 0.05), except
max_step_s: by default 1.25x the expected length of step 0 (min_samples / (steps[0] * rate)), 250 s at
20 requests/s (step 0 overruns it with probability ~1e-4), instead of 1800 s, because each look re-reads
all outcomes, so a ramp's cost grows with the square of its length; a longer last step can only add A/A
promotions (the bound stays alpha) and detections. Traffic is --rate-rps requests/s (20 by default:
an assumed small deployment), looks come every poll_s (5 s) = poll_s * rate requests, and every request
is resolved by the next look (real feedback arrives later, so real seconds are longer by up to
feedback_wait_s). Seeds are shared between the two scenarios (same users and arrivals). Ramps run in
--jobs processes (results do not depend on it: each ramp is seeded by its index); ~65 CPU-seconds in
all with the defaults. Progress goes to stderr; the last stdout line is one JSON object. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.canary_policy import CanaryConfig
from sim.canary_outcomes import ArmModel, RampResult, run_ramp

P_CONTROL, RELATIVE_REGRESSION = 0.30, 0.20


def run_many(label: str, cfg: CanaryConfig, canary: ArmModel, args: argparse.Namespace,
             look_every: int) -> list[RampResult]:
    one = partial(run_ramp, cfg, (ArmModel(P_CONTROL), canary), rate_rps=args.rate_rps, look_every=look_every,
                  max_requests=10**7)
    out: list[RampResult] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(one, range(args.seed, args.seed + args.ramps), chunksize=5):
            out.append(result)
            if len(out) % 25 == 0 or len(out) == args.ramps:
                print(f"[canary] {label}: {len(out)}/{args.ramps} ramps, {dict(Counter(r.action for r in out))}",
                      file=sys.stderr, flush=True)
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ramps", type=int, default=200, help="ramps per scenario (regression, A/A)")
    ap.add_argument("--rate-rps", type=float, default=20.0, help="assumed requests/s to the model, both arms")
    ap.add_argument("--seed", type=int, default=0, help="first seed; ramp i uses seed + i")
    ap.add_argument("--max-step-s", type=float, default=None, help="default: 1.25x the expected length of step 0")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = ap.parse_args(argv)
    base = CanaryConfig()
    step0_s = base.min_samples / (base.steps[0] * args.rate_rps)
    cfg = base.model_copy(update={"max_step_s": args.max_step_s or 1.25 * step0_s})
    look_every = max(1, round(cfg.poll_s * args.rate_rps))
    t0 = time.perf_counter()

    worse = run_many("regression", cfg, ArmModel(P_CONTROL * (1 - RELATIVE_REGRESSION)), args, look_every)
    aa = run_many("A/A", cfg, ArmModel(P_CONTROL), args, look_every)

    hits = [r for r in worse if r.action == "rollback"]
    aa_n = Counter(r.action for r in aa)
    result = {
        "bench": "canary",
        "detect_requests_median": median([r.requests for r in hits]),
        "detect_s_median": median([r.seconds for r in hits]),
        "exposed_share": rounded(median([r.exposed_share for r in hits])),
        "aa_false_alarm_rate": (aa_n["rollback"] + aa_n["promote"]) / len(aa),
        "aa_false_rollback_rate": aa_n["rollback"] / len(aa),
        "aa_false_promotion_rate": aa_n["promote"] / len(aa),
        "aa_inconclusive_rate": aa_n["inconclusive"] / len(aa),
        "detection_rate": len(hits) / len(worse),
        "detect_step_median": median([r.step for r in hits]),
        "detect_steps": {str(k): v for k, v in sorted(Counter(r.step for r in hits).items())},
        "detect_canary_requests_median": median([r.canary_requests for r in hits]),
        # rollbacks before the canary had 30 outcomes: too few for the normal approximation the mSPRT uses
        "detect_under_30_canary": sum(r.canary_requests < 30 for r in hits),
        "detect_reasons": dict(Counter(r.reason.split(":")[0].split(" ")[0] for r in hits)),
        "regression_outcomes": dict(Counter(r.action for r in worse)),
        "ramps": args.ramps, "rate_rps": args.rate_rps, "seed": args.seed,
        "p_control": P_CONTROL, "p_canary": round(P_CONTROL * (1 - RELATIVE_REGRESSION), 4),
        "relative_regression": RELATIVE_REGRESSION, "steps": cfg.steps, "min_samples": cfg.min_samples,
        "alpha": cfg.alpha, "max_step_s": cfg.max_step_s, "look_every_requests": look_every,
        "jobs": args.jobs, "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
