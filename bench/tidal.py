"""Tidal scheduling against a static split: the same simulated day twice in one run, training all day long.

    .venv/bin/python bench/tidal.py [--day-s 480] [--units 3] [--peak-replicas 2] [--peak-rps 4] [--peak-to-trough 4]

What runs: one sandbox platform (Prefect, MLflow, `tab` with LoRA updates on real vLLM replicas, the gateway), a
reward dataset collected from simulated users, then the same simulated day (sim/daily_curve.py, starting in the
trough, the peak half a day later) twice, the users sending Tab requests through the gateway at the curve's rate:

  static  serving sized for the peak: the fleet keeps --peak-replicas all day; training on what is left
          (train.torch_threads = units - peak replicas), run after run, each `tidal train` on the dataset
  tidal   the capacity scheduler (capacity/, its own process) sizes serving to demand between 1 replica and
          --peak-replicas and lends the rest as leases; the same run after run, each on a lease of what serving's
          minimum leaves, preempted at a ramp and resumed on the next lease

A pool unit is one core, of this machine's; --units may declare more than it has (2 here), so that a static
split can leave the trainer a unit beside the peak's replicas: the trainer's threads then share the cores. What
a run trains is what it logged: each finished iteration's tokens (charts/tokens_per_s x charts/iteration_s in its
MLflow run) whose time falls in the day; an iteration cut off at the day's end counts nothing.

Keys of the last stdout line (one JSON object): train_tokens_per_hour_static / _tidal (tokens trained per wall
hour of the day), ratio (tidal / static), p99_ms_static / _tidal (client-side, whole day), slo_minutes_met_share_tidal
(share of the day's wall minutes whose p99 met the model's latency objective), client_errors_tidal (completions that
failed), preemptions (leases revoked), resumed_runs_equal_weights (a run preempted and resumed ends with the trained
weights of the same run trained again without a stop, torch.equal on every tensor; null when no run was both
preempted and finished), capacity_restored_s_p95 (from a revocation to the model having the replicas that
revocation was for, ready), plus per-day details. Progress goes to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.daily_curve import DailyCurve  # noqa: E402
from sim.users import SimTraffic, SimUsersConfig  # noqa: E402
from tidal.sandbox import SPARE, port_block, sandbox_platform  # noqa: E402
from tidal.tokens import admin_token  # noqa: E402

# Short runs that checkpoint only when stopped (or at their end): what a preemption costs is the iteration in flight
# and a trainer start. A gate that lets any sane candidate through: the bench measures training, not the gate.
TRAIN = {
    "ppo": {"max_iterations": 8, "batch_size": 16, "minibatch_size": 8, "kl_coef": 0.2},
    "checkpoint_every": 1000,
    "retry_delay_s": 0.0,
    "gate": {"eval_bytes": 5_000, "max_heldout_rows": 50, "bpb_tolerance": 1.0, "ope_tolerance": 1.0},
}
OBJECTIVE_MS = 2000.0


def say(msg: str) -> None:
    print(f"[tidal] {msg}", file=sys.stderr, flush=True)


class FleetWatch(threading.Thread):
    """(monotonic time, ready replicas of tab) every half second until stopped."""

    def __init__(self, fleet):
        super().__init__(daemon=True)
        self.fleet, self.samples, self.stop = fleet, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                m = self.fleet.status().models["tab"]
            except httpx.HTTPError:
                continue
            self.samples.append((time.time(), sum(r.state == "ready" for r in m.replicas)))


class TrainLoop(threading.Thread):
    """`tidal train tab --dataset D` run after run (a new seed each, so a new run) until stopped; the run in
    progress is then killed with its trainer."""

    def __init__(self, dataset_id: str, env: dict[str, str], seed0: int, log: Path):
        super().__init__(daemon=True)
        self.dataset_id, self.env, self.seed0, self.log = dataset_id, env, seed0, log
        self.stop, self.finished, self.failed, self.proc = threading.Event(), 0, 0, None

    def run(self) -> None:
        seed = self.seed0
        with self.log.open("ab") as out:
            while not self.stop.is_set():
                env = {**self.env, "TIDAL_TRAIN__PPO__SEED": str(seed)}
                cmd = [sys.executable, "-m", "tidal.cli", "train", "tab", "--dataset", self.dataset_id]
                self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                code = self.proc.wait()
                if not self.stop.is_set():
                    self.finished += code == 0
                    self.failed += code != 0
                    say(f"run with seed {seed} ended with exit {code}")
                seed += 1

    def finish(self, timeout_s: float) -> bool:
        """Start no new run; let the one in progress end (True) or kill it after timeout_s (False)."""
        self.stop.set()
        proc = self.proc
        try:
            if proc is not None:
                proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
        finally:
            self.halt()

    def halt(self) -> None:
        self.stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
            for p in family:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        self.join(timeout=60)


def trained_tokens(tracking_uri: str, start: float, end: float) -> tuple[float, int]:
    """(tokens, iterations) logged by tab's train runs with a timestamp in [start, end] (epoch s)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("tab/train")
    tokens, iterations = 0.0, 0
    for run in client.search_runs([exp.experiment_id], max_results=1000):
        tps = {m.step: m for m in client.get_metric_history(run.info.run_id, "charts/tokens_per_s")}
        secs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "charts/iteration_s")}
        for step, m in tps.items():
            if start * 1000 <= m.timestamp <= end * 1000 and step in secs:
                tokens += m.value * secs[step]
                iterations += 1
    return tokens, iterations


def minute_p99s(latencies: list[float], at: list[float], start: float, end: float) -> list[float]:
    """The p99 of each whole wall minute of the day that answered a request (monotonic times)."""
    lat, t = np.asarray(latencies), np.asarray(at)
    out = []
    for a in np.arange(start, end - 59.999, 60.0):
        window = lat[(t >= a) & (t < a + 60)]
        if len(window):
            out.append(float(np.percentile(window, 99)))
    return out


def restored_s(events: list[dict], samples: list[tuple[float, int]]) -> list[float]:
    """Per revocation: seconds until tab had the replicas it was revoked for, ready (None never restored: skipped)."""
    out = []
    for e in events:
        if e["kind"] != "revoke" or not (m := re.search(r"serving needs tab (\d+) replica", e["reason"])):
            continue
        at, want = e["time_ms"] / 1000, int(m.group(1))
        ready = next((t for t, n in samples if t >= at and n >= want), None)
        if ready is not None:
            out.append(ready - at)
    return out


def run_day(mode: str, settings, platform, args, dataset_id: str, base_env: dict[str, str]) -> dict:
    curve = DailyCurve(
        day_s=args.day_s, peak_rps=args.peak_rps, peak_to_trough=args.peak_to_trough, peak_hour=14.0, start_hour=2.0
    )
    cfg = SimUsersConfig(users=400, sites=2000, seed=43, concurrency=8, daily=curve)
    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    env = {**base_env, "TIDAL_CAPACITY__MODE": mode}
    if mode == "static":
        env["TIDAL_TRAIN__TORCH_THREADS"] = str(args.units - args.peak_replicas)
    scheduler, sched_log = None, settings.log_dir / "capacity-bench.log"
    if mode == "tidal":
        with sched_log.open("ab") as out:
            scheduler = subprocess.Popen([sys.executable, "-m", "capacity.scheduler"], env=env, stdout=out, stderr=out)
    watch = FleetWatch(platform.fleet_client())
    users = SimTraffic(cfg, url, settings.gateway.clients[0].key, "tab", settings.bootstrap.heldout_fraction)
    loop = TrainLoop(dataset_id, env, 1000 if mode == "static" else 2000, settings.log_dir / f"bench-train-{mode}.log")
    status, finished_after = None, None
    try:
        watch.start()
        wall0, mono0 = time.time(), time.monotonic()
        users.start()
        loop.start()
        while (left := args.day_s - (time.monotonic() - mono0)) > 0:
            time.sleep(min(30.0, left))
            say(
                f"{mode}: {time.monotonic() - mono0:.0f}/{args.day_s:.0f} s, {len(users.tally.acked)} answered, {loop.finished} runs"
            )
        wall1, mono1 = time.time(), time.monotonic()
        users.stop.set()
        if mode == "tidal":  # the run a revocation stopped resumes once the users are gone, so that its weights can be
            # compared with an uninterrupted run's (its iterations after the day count nothing)
            finished_after = loop.finish(args.finish_s)
        users.join(timeout=120)
        if scheduler is not None:
            status = httpx.get(
                f"http://{settings.capacity.host}:{base_env['TIDAL_CAPACITY__PORT']}/capacity",
                headers={"Authorization": f"Bearer {admin_token(settings)}"},
                timeout=30,
            ).json()
    finally:  # whatever happened, nothing of this day outlives it
        users.stop.set()
        watch.stop.set()
        if loop.is_alive():
            loop.halt()
        if scheduler is not None and scheduler.poll() is None:
            scheduler.terminate()
            scheduler.wait(30)
    tokens, iterations = trained_tokens(settings.mlflow.tracking_uri, wall0, wall1)
    tally = users.tally
    minutes = minute_p99s(tally.latencies_ms, tally.answered_at, mono0, mono1)
    events = status["events"] if status else []
    restore = restored_s(events, watch.samples)
    if mode == "static":  # the fleet back at the peak's replicas for the next day (the tidal day scales it itself)
        platform.fleet_client().scale("tab", args.peak_replicas)
    return {
        "hours": (wall1 - wall0) / 3600,
        "tokens": tokens,
        "iterations": iterations,
        "runs_finished": loop.finished,
        "runs_failed": loop.failed,
        "last_run_finished_after_the_day": finished_after,
        "requests": len(tally.acked),
        "client_errors": sum(e.startswith("completion") for e in tally.errors),
        "client_error_samples": [e for e in tally.errors if e.startswith("completion")][:3],
        "p99_ms": float(np.percentile(tally.latencies_ms, 99)) if tally.latencies_ms else None,
        "minute_p99s": minutes,
        "revocations": sum(e["kind"] == "revoke" for e in events),
        "grants": sum(e["kind"] == "grant" for e in events),
        "restored_s": restore,
        "fewest_ready": min((n for _, n in watch.samples), default=None),
        "events": [f"{e['kind']}: {e['reason'][:160]}" for e in events],
    }


def resumed_equal(settings, log: Path) -> bool | None:
    """Train a run that was preempted and finished again from scratch, uninterrupted, with the same spec (threads
    included) under another key, and compare the final trained tensors."""
    import torch
    from mlflow import MlflowClient

    from tidal.store import open_store
    from training.job_spec import TrainJob
    from training.run_files import latest_state_key, load_state

    text, store = log.read_text(), open_store(settings)
    stopped = set(re.findall(r"(run-[0-9a-f]+): stop requested", text))
    done = [k for k in sorted(stopped) if store.exists(f"training/model=tab/{k}/result.json")]
    if not done:
        return None
    key = done[0]
    spec = TrainJob.model_validate_json((settings.run_dir / f"train-tab-{key}.json").read_text())
    client = MlflowClient(settings.mlflow.tracking_uri)
    run = client.create_run(client.get_experiment_by_name("tab/train").experiment_id, run_name=f"{key}-reference")
    ref = spec.model_copy(update={"run_key": f"{key}-reference", "mlflow_run_id": run.info.run_id, "pushgateway_url": None})
    path = settings.run_dir / f"train-tab-{key}-reference.json"
    path.write_text(ref.model_dump_json())
    say(f"training {key} again without a stop, on {spec.torch_threads} thread(s)")
    code = subprocess.run([sys.executable, "-m", "training.job", "train", str(path)], capture_output=True, text=True)
    if code.returncode != 0:
        raise RuntimeError(f"the reference run failed: {code.stdout[-2000:]}{code.stderr[-2000:]}")
    a = load_state(store, latest_state_key(store, spec.prefix))["trainable"]
    b = load_state(store, latest_state_key(store, ref.prefix))["trainable"]
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def collect_dataset(settings, requests: int) -> str:
    from flows.collect import collect  # after the sandbox pointed Prefect at its server

    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    cfg = SimUsersConfig(users=400, sites=2000, seed=41, concurrency=4)
    users = SimTraffic(cfg, url, settings.gateway.clients[0].key, "tab", settings.bootstrap.heldout_fraction, requests)
    users.start()
    users.join()
    time.sleep(settings.collect.upload_grace_s + 3)  # the last verdicts reach the store
    return collect(model="tab", include_open_hour=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--day-s", type=float, default=480.0, help="wall seconds of one simulated day")
    ap.add_argument("--units", type=int, default=3, help="cores in the pool (serving's and training's)")
    ap.add_argument("--peak-replicas", type=int, default=2, help="replicas the peak needs (the static split's serving)")
    ap.add_argument("--peak-rps", type=float, default=4.0, help="requests/s at the peak")
    ap.add_argument("--peak-to-trough", type=float, default=4.0, help="how many times busier the peak is")
    ap.add_argument("--finish-s", type=float, default=300.0, help="tidal: how long the run in progress may finish after the day")
    ap.add_argument("--dataset-requests", type=int, default=200, help="completions collected into the training dataset")
    args = ap.parse_args()
    if args.units <= args.peak_replicas:
        sys.exit(f"--units {args.units} leaves a static split no unit for training beside --peak-replicas {args.peak_replicas}")

    base = port_block()
    cap_port = base + SPARE
    # The peak needs --peak-replicas at rps_per_replica with 25% headroom; the trough one replica.
    per_replica = args.peak_rps * 1.25 / args.peak_replicas
    capacity = {
        "model": {"min_replicas": 1, "max_replicas": args.peak_replicas, "rps_per_replica": per_replica},
        "pool": {
            "total_units": args.units,
            "port": cap_port,
            "tick_s": 2.0,
            "scale_down_after_s": args.day_s / 48,  # half an hour of the day
            "lease": {"grace_s": 60.0, "heartbeat_s": 2.0},
            # The recent level alone. With the previous day's term, the lookahead (a replica's start: minutes here,
            # hours of a compressed day) reaches from the evening into the next morning's ramp, which the day's own
            # morning foretells, and the peak's replicas stay all evening: right for the forecast, but not the
            # day's tide. The recent average spans a quarter of an hour of the day.
            "forecast": {"day_s": args.day_s, "recent_s": args.day_s / 96, "yesterday_weight": 0.0},
        },
    }
    models = [
        {
            "name": "tab",
            "replicas": args.peak_replicas,
            "update_strategy": "lora",
            "capacity": capacity["model"] | {"headroom": 0.25, "latency_objective_ms": OBJECTIVE_MS},
        }
    ]
    with sandbox_platform(
        models, base_port=base, gateway=True, train=TRAIN, capacity=capacity["pool"], flywheel={"loop": "manual"}
    ) as (settings, platform):
        say("collecting the training dataset")
        dataset_id = collect_dataset(settings, args.dataset_requests)
        env = dict(os.environ) | {"TIDAL_CAPACITY__PORT": str(cap_port)}
        days = {}
        for mode in ("static", "tidal"):
            say(f"{mode} day: {args.day_s:.0f} s")
            days[mode] = run_day(mode, settings, platform, args, dataset_id, env)
        try:
            equal, equal_error = resumed_equal(settings, settings.log_dir / "train-tab.log"), None
        except Exception as e:  # noqa: BLE001  the days' figures are still printed, with why this one is missing
            equal, equal_error = None, repr(e)[:500]

    static, tidal = days["static"], days["tidal"]
    per_hour = {m: d["tokens"] / d["hours"] for m, d in days.items()}
    minutes = tidal["minute_p99s"]
    restored = tidal["restored_s"]
    print(
        json.dumps(
            {
                "train_tokens_per_hour_static": round(per_hour["static"]),
                "train_tokens_per_hour_tidal": round(per_hour["tidal"]),
                "ratio": round(per_hour["tidal"] / per_hour["static"], 3) if per_hour["static"] else None,
                "p99_ms_static": static["p99_ms"],
                "p99_ms_tidal": tidal["p99_ms"],
                "slo_minutes_met_share_tidal": (sum(p <= OBJECTIVE_MS for p in minutes) / len(minutes)) if minutes else None,
                "client_errors_tidal": tidal["client_errors"],
                "preemptions": tidal["revocations"],
                "resumed_runs_equal_weights": equal,
                "resumed_runs_error": equal_error,
                "capacity_restored_s_p95": float(np.percentile(restored, 95)) if restored else None,
                "latency_objective_ms": OBJECTIVE_MS,
                "day_s": args.day_s,
                "units": args.units,
                "cores": os.cpu_count(),
                "peak_replicas": args.peak_replicas,
                "days": days,
            }
        )
    )


if __name__ == "__main__":
    main()
