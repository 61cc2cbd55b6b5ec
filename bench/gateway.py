"""Gateway overhead: the same requests straight to the engine and through the gateway (logging on),
side by side in one run, at concurrency 1, 16 and 64. Prints one JSON line:
  added_p50_ms, added_p99_ms, throughput_ratio   (at concurrency 64; ratio = gateway / direct)
  by_concurrency: {c: {added_p50_ms, added_p99_ms, throughput_ratio, direct_rps, gateway_rps}}
Usage: .venv/bin/python bench/gateway.py [--requests N] [--rounds R] [--max-tokens T]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.logsink import LogSinkSettings  # noqa: E402
from tidal.sandbox import sandbox_platform  # noqa: E402

PROMPT = "import os\n\ndef read_config(path):\n    with open(path) as f:\n        return"


async def run_load(url: str, headers: dict, make_body, concurrency: int, n: int) -> tuple[list[float], float]:
    """n requests from `concurrency` workers; (per-request latencies in ms, wall seconds)."""
    latencies: list[float] = []
    counter = iter(range(n))
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker():
            for i in counter:
                t0 = time.perf_counter()
                async with session.post(url, json=make_body(i)) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} -> {r.status}: {await r.text()}")
                latencies.append((time.perf_counter() - t0) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid and its descendants (affinity is per thread on Linux)."""
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, PermissionError):
                pass


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def measure(
    direct_url: str, gw_url: str, key: str, served: str, levels, n: int, rounds: int, max_tokens: int, gw_pid: int
) -> dict:
    def direct_body(i: int) -> dict:  # the engine's own API, asked for what the gateway asks it for
        return {
            "model": served,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        }

    def gw_body(i: int) -> dict:
        return {"model": "tab", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "user": f"u{i}"}

    out = {}
    for c in levels:
        await run_load(direct_url, {}, direct_body, c, min(n, 4 * c))  # warm connections and caches
        await run_load(gw_url, {"Authorization": f"Bearer {key}"}, gw_body, c, min(n, 4 * c))
        d_lat, g_lat, d_s, g_s, g_cpu = [], [], 0.0, 0.0, 0.0
        for _ in range(rounds):  # interleaved, so drift on a shared machine hits both sides alike
            lat, s = await run_load(direct_url, {}, direct_body, c, n)
            d_lat += lat
            d_s += s
            cpu0 = cpu_s(gw_pid)
            lat, s = await run_load(gw_url, {"Authorization": f"Bearer {key}"}, gw_body, c, n)
            g_cpu += cpu_s(gw_pid) - cpu0
            g_lat += lat
            g_s += s
        d_rps, g_rps = len(d_lat) / d_s, len(g_lat) / g_s
        out[str(c)] = {
            "added_p50_ms": round(pct(g_lat, 50) - pct(d_lat, 50), 3),
            "added_p99_ms": round(pct(g_lat, 99) - pct(d_lat, 99), 3),
            "throughput_ratio": round(g_rps / d_rps, 3),
            "direct_rps": round(d_rps, 1),
            "gateway_rps": round(g_rps, 1),
            "direct_p50_ms": round(pct(d_lat, 50), 2),
            "direct_p99_ms": round(pct(d_lat, 99), 2),
            # CPU the gateway process spent per request: its cost independent of machine contention
            "gateway_cpu_ms_per_request": round(g_cpu / len(g_lat) * 1000, 3),
        }
        print(f"concurrency {c}: {out[str(c)]}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per side per round and level")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="give the engine CPU 0 to itself (on a small machine: helps at high concurrency, hurts at 1)",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    # The log sink as deployed (LogSinkSettings defaults), not the sandbox's quick uploads for tests: with 1 s
    # segments, uploading Parquet every second was most of the gateway's CPU at concurrency 1.
    logsink = LogSinkSettings().model_dump(mode="json")
    with sandbox_platform(
        [{"name": "tab", "replicas": 1}], pretrain_seconds=20, gateway=True, gateway_settings={"logsink": logsink}
    ) as (settings, platform):
        (replica,) = platform.fleet_client().replicas("tab")
        served = next(iter(replica.served))
        key = settings.gateway.clients[0].key
        gw = f"http://{settings.gateway.host}:{settings.gateway.port}/v1/completions"
        time.sleep(2 * settings.gateway.fleet_poll_s)
        isolated = args.isolate and os.cpu_count() >= 2
        if isolated:
            # The engine gets CPU 0 to itself; gateway, load generator and the rest share the others.
            # Without this, on a small machine the ratio measures CPU contention with the engine,
            # not what the gateway adds in front of it.
            others = set(range(1, os.cpu_count()))
            for name in ("gateway", "fleet", "prefect", "mlflow"):
                pin(platform.running(name).pid, others)
            pin(os.getpid(), others)
            pin(replica.pid, {0})
        by_c = asyncio.run(
            measure(
                replica.url + "/v1/completions",
                gw,
                key,
                served,
                levels,
                args.requests,
                args.rounds,
                args.max_tokens,
                platform.running("gateway").pid,
            )
        )
    top = by_c[str(max(levels))]
    print(
        json.dumps(
            {
                "added_p50_ms": top["added_p50_ms"],
                "added_p99_ms": top["added_p99_ms"],
                "throughput_ratio": top["throughput_ratio"],
                "by_concurrency": by_c,
                "cpus": os.cpu_count(),
                "engine_cpu_isolated": isolated,
                "max_tokens": args.max_tokens,
                "requests": args.requests,
                "rounds": args.rounds,
                "logsink": {k: logsink[k] for k in ("segment_max_age_s", "upload_interval_s", "commit_interval_ms")},
            }
        )
    )


if __name__ == "__main__":
    main()
