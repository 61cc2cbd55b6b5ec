"""One flywheel cycle, timed by stage, and the share of it that orchestration takes.

    .venv/bin/python bench/cycle.py [--requests 1200] [--quick]

What runs: a sandbox platform (Prefect, MLflow, one `tab` replica with LoRA updates, the gateway) with the
demo's training and canary settings (`demo.train`, `demo.canary`; --quick: a 6-iteration PPO run and one
canary step of at most 2 minutes), simulated users until --requests completions are acknowledged, then one
flywheel cycle (collect → train → canary → promote or roll back) run in this process while the users go on.

What is measured (wall clock, from Prefect's own run records and timers around this process's API calls):
  stages_s        seconds of each stage's subflow run (collect, train, promote), and `cycle_other`: the
                  flywheel's own tasks and the gaps between its stages
  total_s         seconds of the flywheel call
  overhead_share  orchestration seconds / total_s. Orchestration is the union (each second counted once) of
                  - prefect: the cycle's time outside every task run (creating runs, state changes, subflow
                    set-up, result handling), plus Prefect API calls made from inside tasks;
                  - mlflow: MLflow REST calls of the flow's thread, plus the trainer's own MLflow seconds
                    (`mlflow_s` of its result.json), which run in the trainer's process;
                  - contracts: the data-contract task runs (Great Expectations validation, quarantine, data docs).
                  `overhead_s` gives each part on its own. Work is everything else: reading and writing logs and
                  datasets, PPO, the offline gate, loading and verifying weights, and serving the canary.
Calls made by Prefect's background workers (log shipping, events) don't block the cycle and are not counted.
Progress goes to stderr; the last stdout line is one JSON object. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.soak import CANARY as QUICK_CANARY  # noqa: E402  the soak's short cycle: one 2-minute 50% step
from bench.soak import TRAIN as QUICK_TRAIN  # noqa: E402  and a 6-iteration PPO run

Interval = tuple[float, float]  # (start, end), epoch seconds
STAGES = ("collect", "train", "promote")
CONTRACT_TASKS = {"validate_logs", "quarantine_failures", "publish_data_docs"}


def say(msg: str) -> None:
    print(f"[cycle] {msg}", file=sys.stderr, flush=True)


# ---- interval arithmetic (pure; tests/unit/test_bench_cycle.py) -------------------------------------------


def merged(intervals: list[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same seconds."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in merged(intervals))


def clipped(intervals: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def complement(intervals: list[Interval], window: Interval) -> list[Interval]:
    """The seconds of `window` covered by none of `intervals`."""
    out, at = [], window[0]
    for a, b in merged(clipped(intervals, window)):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, window[1])] if at < window[1] else [])


def overhead(
    window: Interval,
    tasks: dict[str, list[Interval]],
    prefect_calls: list[Interval],
    mlflow_calls: list[Interval],
    trainer_mlflow_s: float,
) -> dict[str, float]:
    """Orchestration seconds of one cycle (see the module docstring), each part alone and their union.

    tasks: task name → run intervals (subflow wrapper task runs excluded); the trainer's MLflow seconds happen
    inside the run_trainer task, in another process, so they add to the union as they are."""
    inside = [i for name, runs in tasks.items() for i in runs]
    contracts = [i for name, runs in tasks.items() if name in CONTRACT_TASKS for i in runs]
    outside = complement(inside, window)
    prefect = outside + clipped(prefect_calls, window)
    mlflow = clipped(mlflow_calls, window)
    return {
        "prefect": round(length(prefect), 3),
        "mlflow": round(length(mlflow) + trainer_mlflow_s, 3),
        "contracts": round(length(contracts), 3),
        "union": round(length(prefect + mlflow + contracts) + trainer_mlflow_s, 3),
    }


# ---- timers around this thread's API calls ----------------------------------------------------------------


@contextmanager
def call_timers(mlflow_url: str, thread_id: int):
    """Records (start, end) of every Prefect and MLflow HTTP call made by thread `thread_id` while open.
    Prefect's sync client is an httpx.Client subclass; MLflow's REST store sends through requests."""
    import requests
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    calls: dict[str, list[Interval]] = {"prefect": [], "mlflow": []}
    originals = (PrefectHttpxSyncClient.send, PrefectHttpxAsyncClient.send, requests.Session.request)

    def sync_send(self, request, *args, **kwargs):
        t = time.time()
        try:
            return originals[0](self, request, *args, **kwargs)
        finally:
            if threading.get_ident() == thread_id:
                calls["prefect"].append((t, time.time()))

    async def async_send(self, request, *args, **kwargs):
        t = time.time()
        try:
            return await originals[1](self, request, *args, **kwargs)
        finally:
            if threading.get_ident() == thread_id:
                calls["prefect"].append((t, time.time()))

    def mlflow_request(self, method, url, *args, **kwargs):
        t = time.time()
        try:
            return originals[2](self, method, url, *args, **kwargs)
        finally:
            if threading.get_ident() == thread_id and str(url).startswith(mlflow_url):
                calls["mlflow"].append((t, time.time()))

    PrefectHttpxSyncClient.send, PrefectHttpxAsyncClient.send, requests.Session.request = sync_send, async_send, mlflow_request
    try:
        yield calls
    finally:
        PrefectHttpxSyncClient.send, PrefectHttpxAsyncClient.send, requests.Session.request = originals


# ---- Prefect's run records ---------------------------------------------------------------------------------


def ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def run_tree(api: str, root_id: str) -> tuple[dict[str, Interval], dict[str, list[Interval]]]:
    """(stage flow name → its run's interval, task name → its runs' intervals) of a flow run and its subflows."""
    with httpx.Client(base_url=api, timeout=30) as http:
        flow_runs, frontier = [http.get(f"/flow_runs/{root_id}").json()], [root_id]
        while frontier:
            children = http.post("/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": frontier}}}).json()
            flow_runs += children
            frontier = [r["id"] for r in children]
        names = {fid: http.get(f"/flows/{fid}").json()["name"] for fid in {r["flow_id"] for r in flow_runs}}
        task_runs = http.post(
            "/task_runs/filter",
            json={
                "flow_runs": {"id": {"any_": [r["id"] for r in flow_runs]}},
                "task_runs": {"subflow_runs": {"exists_": False}},
                "limit": 200,
            },
        ).json()
    stages = {
        names[r["flow_id"]]: (ts(r["start_time"]), ts(r["end_time"]))
        for r in flow_runs
        if names[r["flow_id"]] in STAGES and r["start_time"] and r["end_time"]
    }
    tasks: dict[str, list[Interval]] = {}
    for t in task_runs:
        if t["start_time"] and t["end_time"]:
            tasks.setdefault(t["name"].rsplit("-", 1)[0], []).append((ts(t["start_time"]), ts(t["end_time"])))
    return stages, tasks


def trainer_mlflow_seconds(store) -> float:
    """mlflow_s of every training result in the sandbox's store: only this cycle trains there."""
    from tidal.store import get_json
    from training.job_spec import TrainResult

    return sum(
        TrainResult.model_validate(get_json(store, key)).mlflow_s
        for key in store.list("training/model=tab/")
        if key.endswith("/result.json")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--requests", type=int, default=None, help="completions acknowledged before the cycle (default: demo.requests_per_cycle)"
    )
    ap.add_argument("--concurrency", type=int, default=2, help="simulated requests in flight at once")
    ap.add_argument("--quick", action="store_true", help="a 6-iteration PPO run and one 2-minute canary step")
    args = ap.parse_args()

    from sim.users import SimTraffic, SimUsersConfig
    from tidal.loop_settings import DemoSettings
    from tidal.sandbox import sandbox_platform
    from tidal.store import open_store

    demo = DemoSettings()
    train = QUICK_TRAIN if args.quick else demo.train.model_dump(mode="json")
    canary = QUICK_CANARY if args.quick else demo.canary.model_dump(mode="json")
    requests_needed = args.requests or demo.requests_per_cycle
    models = [{"name": "tab", "replicas": 1, "update_strategy": "lora"}]
    with sandbox_platform(models, gateway=True, train=train, canary=canary, flywheel={"loop": "manual"}) as (settings, platform):
        from flows.flywheel import flywheel  # after the sandbox pointed Prefect at its server

        url = f"http://{settings.gateway.host}:{settings.gateway.port}"
        time.sleep(2 * settings.gateway.fleet_poll_s)
        cfg = SimUsersConfig(users=400, sites=2000, seed=41, concurrency=args.concurrency)
        users = SimTraffic(cfg, url, settings.gateway.clients[0].key, "tab", settings.bootstrap.heldout_fraction)
        users.start()
        while len(users.tally.acked) < requests_needed:
            time.sleep(5)
            say(f"{len(users.tally.acked)}/{requests_needed} completions acknowledged")
        time.sleep(settings.collect.upload_grace_s + 3)  # the last feedback reaches the store
        say("flywheel cycle started")
        with call_timers(settings.mlflow.tracking_uri, threading.get_ident()) as calls:
            t0 = time.time()
            state = flywheel(model="tab", cycles=1, include_open_hour=True, return_state=True)
            t1 = time.time()
        [report] = state.result()
        users.stop.set()
        users.join(timeout=120)
        stages, tasks = run_tree(settings.prefect.api_url, str(state.state_details.flow_run_id))
        parts = overhead((t0, t1), tasks, calls["prefect"], calls["mlflow"], trainer_mlflow_seconds(open_store(settings)))
    total = t1 - t0
    stages_s = {name: round(b - a, 2) for name, (a, b) in stages.items()}
    stages_s["cycle_other"] = round(total - sum(stages_s.values()), 2)
    print(
        json.dumps(
            {
                "stages_s": stages_s,
                "total_s": round(total, 2),
                "overhead_share": round(parts["union"] / total, 4),
                "overhead_s": parts,
                "decision": report.decision,
                "reason": report.reason,
                "task_s": {name: round(sum(b - a for a, b in runs), 2) for name, runs in sorted(tasks.items())},
                "prefect_calls": len(calls["prefect"]),
                "mlflow_calls": len(calls["mlflow"]),
                "requests_before_cycle": requests_needed,
                "quick": args.quick,
            }
        )
    )


if __name__ == "__main__":
    main()
