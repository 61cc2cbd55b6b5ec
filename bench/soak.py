"""Soak: the whole platform under steady simulated load for a while, with one flywheel cycle in between.

    .venv/bin/python bench/soak.py [--minutes 10] [--concurrency 2] [--cycle-after-s 60] [--no-cycle]

What runs: a sandbox platform (Prefect, MLflow, a 2-replica `tab` fleet with LoRA updates, the gateway),
simulated users (sim/users.py, the OpenAI SDK, feedback from the code they meant to type) for --minutes,
and, --cycle-after-s into the run, one flywheel cycle (collect → train → canary → promote or roll back)
with a short PPO run and a one-step canary, so the loop's own load lands on serving.

What is measured, over the whole run: client-side p50/p99 latency of acknowledged completions, error
rate (failed / all completion requests), resident memory of each platform process at the end of the
warm-up (--warmup-s) and at the end (growth in MB; a process restarted meanwhile is reported as such),
and records: completions acknowledged to users vs stored in the object store exactly once (read back
after the run). Progress goes to stderr; the last stdout line is one JSON object with the keys p50_ms,
p99_ms, error_rate, rss_growth_mb (the largest growth of any process), records_acked, records_stored,
plus the per-process figures and the cycle's decision. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.audit import not_exactly_once, wait_stored  # noqa: E402
from sim.users import SimTraffic, SimUsersConfig  # noqa: E402
from tidal.sandbox import sandbox_platform  # noqa: E402
from tidal.store import open_store  # noqa: E402

# A cycle sized for two cores under load: a short PPO run and one 50% canary step of at most two minutes.
TRAIN = {
    "ppo": {"max_iterations": 6, "batch_size": 32, "minibatch_size": 8, "kl_coef": 0.2},
    "retry_delay_s": 0.0,
    "gate": {"eval_bytes": 20_000, "bpb_tolerance": 0.2},
}
CANARY = {
    "steps": [0.5],
    "min_samples": 60,
    "max_step_s": 120,
    "poll_s": 2,
    "feedback_wait_s": 5,
    "unload_grace_s": 0,
    "mixture_sd": 0.5,
}


def say(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def processes(platform) -> dict[str, int]:
    """name → pid of every platform process: the servers, the gateway, the fleet and each replica."""
    out = {name: info.pid for name in ("prefect", "mlflow", "fleet", "gateway") if (info := platform.running(name))}
    for r in platform.fleet_client().replicas("tab"):
        if r.pid:
            out[f"replica:{r.name}"] = r.pid
    return out


def rss_mb(pid: int, others: set[int]) -> float:
    """Resident memory of a process and its children (MLflow and Prefect serve from child processes), less the
    children reported on their own (`others`: the fleet supervisor's replicas)."""
    total, todo = 0, [psutil.Process(pid)]
    while todo:
        p = todo.pop()
        try:
            total += p.memory_info().rss
            todo += [c for c in p.children() if c.pid not in others]
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1) if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="memory baseline taken this long into the load")
    ap.add_argument("--cycle-after-s", type=float, default=60.0, help="when the flywheel cycle starts")
    ap.add_argument("--no-cycle", action="store_true", help="load only")
    args = ap.parse_args()
    if args.warmup_s >= args.minutes * 60:
        ap.error(f"--warmup-s {args.warmup_s} must be shorter than the run ({args.minutes * 60:.0f} s)")

    models = [{"name": "tab", "replicas": 2, "update_strategy": "lora"}]
    with sandbox_platform(models, gateway=True, train=TRAIN, canary=CANARY, flywheel={"loop": "manual"}) as (settings, platform):
        url = f"http://{settings.gateway.host}:{settings.gateway.port}"
        time.sleep(2 * settings.gateway.fleet_poll_s)
        cfg = SimUsersConfig(
            users=200, sites=1000, seed=31, concurrency=args.concurrency, think_s=(0.1, 0.5), feedback_delay_s=(0.2, 2.0)
        )
        users = SimTraffic(cfg, url, settings.gateway.clients[0].key, "tab", settings.bootstrap.heldout_fraction)
        t0, t0_ms = time.monotonic(), int(time.time() * 1000)
        users.start()
        cycle: dict = {}

        def run_cycle() -> None:
            from flows.flywheel import flywheel  # after the sandbox pointed Prefect at its server

            try:
                [report] = flywheel(model="tab", cycles=1, include_open_hour=True)
                cycle.update(decision=report.decision, reason=report.reason)
            except Exception as e:  # noqa: BLE001  a failed cycle is a finding of the soak, reported
                cycle.update(decision="failed", reason=repr(e)[:300])
            cycle["seconds"] = round(time.monotonic() - started, 1)

        time.sleep(args.warmup_s)
        procs = processes(platform)
        before = {name: (pid, rss_mb(pid, set(procs.values()) - {pid})) for name, pid in procs.items()}
        say(f"baseline after {args.warmup_s:.0f} s: " + ", ".join(f"{n} {m:.0f} MB" for n, (_, m) in before.items()))
        worker = None
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            if worker is None and not args.no_cycle and time.monotonic() - t0 >= args.cycle_after_s:
                started = time.monotonic()
                worker = threading.Thread(target=run_cycle, name="flywheel-cycle", daemon=True)
                worker.start()
                say("flywheel cycle started")
            time.sleep(5)
            say(
                f"{time.monotonic() - t0:.0f} s: {len(users.tally.acked)} acknowledged, {len(users.tally.errors)} errors"
                + (f", cycle {cycle.get('decision', 'running')}" if worker else "")
            )
        if worker is not None:
            worker.join()  # the cycle may outlast the load's length: it is part of the run
        after = processes(platform)
        growth = {}
        for name, (pid, mb) in before.items():
            if after.get(name) == pid:
                growth[name] = round(rss_mb(pid, set(after.values()) - {pid}) - mb, 1)
            else:
                growth[name] = "restarted"
        users.stop.set()
        users.join(timeout=120)
        tally = users.tally
        rows = [r for r in wait_stored(open_store(settings), "completions", set(tally.acked), 120) if r["time_ms"] >= t0_ms]
        missing_or_doubled = not_exactly_once(tally.acked, rows)
        wall = time.monotonic() - t0
    numeric = [v for v in growth.values() if isinstance(v, float)]
    print(
        json.dumps(
            {
                "p50_ms": pct(tally.latencies_ms, 0.5),
                "p99_ms": pct(tally.latencies_ms, 0.99),
                "error_rate": round(len(tally.errors) / max(1, len(tally.errors) + len(tally.acked)), 5),
                "rss_growth_mb": max(numeric, default=0.0),
                "records_acked": len(tally.acked),
                "records_stored": len(tally.acked) - len(missing_or_doubled),
                "records_stored_total": len(rows),
                "rss_growth_by_process_mb": growth,
                "rss_baseline_mb": {n: round(m, 1) for n, (_, m) in before.items()},
                "errors_sample": tally.errors[:3],
                "cycle": cycle or None,
                "wall_s": round(wall, 1),
                "minutes": args.minutes,
                "concurrency": args.concurrency,
            }
        )
    )


if __name__ == "__main__":
    main()
