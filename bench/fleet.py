"""Fleet benchmark: replica cold start, LoRA version load, crash-restart-to-ready, RSS per replica.

Runs its own platform (temporary directory, free ports, short bootstrap) and prints one JSON line:
  cold_start_s     scale 0→1 until the replica is ready and its probe passed
  lora_load_s      deploy a LoRA version: load on the replica + probe (lora_load_raw_s: engine call alone)
  restart_ready_s  kill -9 of a ready replica until it serves verified weights again
  rss_mb           resident memory of one replica's process tree
Usage: .venv/bin/python bench/fleet.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidal import lineage  # noqa: E402
from tidal.registry import CheckpointCache, Registry, publish  # noqa: E402
from tidal.sandbox import sandbox_platform  # noqa: E402
from tidal.store import open_store  # noqa: E402
from training.variants import random_adapter  # noqa: E402


def tree_rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def wait_restarted(client, model: str, name: str, old_pid: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in client.replicas(model):
            if r.name == name and r.state == "ready" and r.pid != old_pid:
                return
        time.sleep(0.2)
    raise TimeoutError(f"replica {name} not back after {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="measurements per figure (median reported)")
    args = ap.parse_args()

    cold, lora, lora_raw, restart, rss = [], [], [], [], []
    with sandbox_platform([{"name": "tab", "replicas": 0}], pretrain_seconds=20) as (settings, platform):
        client = platform.fleet_client()
        registry, store = Registry(settings.mlflow.tracking_uri), open_store(settings)
        base_dir = CheckpointCache(store, settings.data_path / "cache").local_dir(registry.get("tab", 1))

        for i in range(args.repeats):
            t0 = time.perf_counter()
            client.scale("tab", 1)
            cold.append(time.perf_counter() - t0)
            (replica,) = client.replicas("tab")
            rss.append(tree_rss_mb(replica.pid))

            adapter = random_adapter(base_dir, settings.data_path / f"bench-adapter{i}", seed=i)
            version = publish(registry, store, "tab", adapter, "lora", 1, {lineage.ORIGIN: "bench"})
            t0 = time.perf_counter()
            client.deploy("tab", version.version)
            lora.append(time.perf_counter() - t0)
            client.undeploy("tab", version.version)
            t0 = time.perf_counter()  # the engine's own load call, without the probe
            httpx.post(
                f"{replica.url}/v1/load_lora_adapter", json={"lora_name": "bench", "lora_path": str(adapter)}, timeout=60
            ).raise_for_status()
            lora_raw.append(time.perf_counter() - t0)
            httpx.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": "bench"}, timeout=60).raise_for_status()

            t0 = time.perf_counter()
            os.kill(replica.pid, signal.SIGKILL)
            wait_restarted(client, "tab", replica.name, replica.pid)
            restart.append(time.perf_counter() - t0)
            client.scale("tab", 0)

    med = statistics.median
    print(
        json.dumps(
            {
                "cold_start_s": round(med(cold), 2),
                "lora_load_s": round(med(lora), 3),
                "lora_load_raw_s": round(med(lora_raw), 3),
                "restart_ready_s": round(med(restart), 2),
                "rss_mb": round(med(rss), 1),
                "repeats": args.repeats,
                "settings": {
                    "health_interval_s": settings.fleet.health_interval_s,
                    "restart_backoff_s": settings.fleet.restart_backoff_s,
                    "enforce_eager": settings.engine.enforce_eager,
                    "dtype": settings.engine.dtype,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
