"""Gateway data plane beside vllm-router, on the same engine: the same requests straight to the engine, through
vllm-router (the vLLM production stack's Rust router, no logging) and through Tidal's gateway (durable logging on:
fsync before the answer, token ids, log-probs, signed ids), in interleaved rounds at concurrency 1, 16 and 64,
then streamed for the time to first byte.

vllm-router runs from a benchmark-only venv (~/.cache/tidal/envs/bench-vllm-router-<version>, created on first use
with `pip install vllm-router==<version>`; never a project requirement). Every side asks the engine for the same
work: greedy decoding, the same prompts and max_tokens, log-probs and token ids (what the gateway asks for).

Progress goes to stderr; the last stdout line is one JSON object:
  by_concurrency: {c: {direct_rps, router_rps, tidal_rps, ratio_vs_router, ratio_vs_router_rounds (each round's,
                  for the spread), p50_ms, p99_ms and ttfb_p50_ms per side, added_p50_vs_router_ms,
                  ttfb_added_vs_router_ms (the first token's arrival), cpu_ms_per_request and
                  cpu_ms_per_streamed_request per proxy (user + system, from /proc)}}
  targets: the issue's four figures, each with its bound and whether this run met it.
Nothing is asserted on the timings: a shared machine's noise shows in the per-round spread.
Usage: .venv/bin/python -m bench.gateway [--requests N] [--rounds R] [--max-tokens T] [--levels 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from serving.logsink import LogSinkSettings
from tidal.procs import wait_http
from tidal.sandbox import SPARE, sandbox_platform

ROUTER_VERSION = "0.1.17"
PY_SPY_VERSION = "0.4.3"
ROUTER_ENV = Path.home() / ".cache" / "tidal" / "envs" / f"bench-vllm-router-{ROUTER_VERSION}"
# Tab-like prompts of different lengths, cycled by request index: every side gets the same sequence.
PROMPTS = [
    "import os\n\ndef read_config(path):\n    with open(path) as f:\n        return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.",
    "def mean(xs):\n    if not xs:\n        raise ValueError('empty')\n    return sum(xs) /",
    "for i, line in enumerate(lines):\n    if line.startswith('#'):\n        continue\n    fields = line.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_bench_env(env: Path = ROUTER_ENV) -> Path:
    """The benchmark venv's bin folder (vllm-router, py-spy), creating the venv on first use."""
    if not (env / "bin" / "vllm-router").is_file() or not (env / "bin" / "py-spy").is_file():
        reqs = [f"vllm-router=={ROUTER_VERSION}", f"py-spy=={PY_SPY_VERSION}"]
        log(f"creating {env} (first run: pip install {' '.join(reqs)})")
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        subprocess.run(pip + reqs, check=True, stdout=sys.stderr)
    return env / "bin"


@contextmanager
def profiled(bin_dir: Path, pid: int, out: Path | None) -> Iterator[None]:
    """py-spy sampling pid while the block runs, as collapsed stacks in `out` (nothing when out is None): only the
    thread holding the GIL, so waits (the event loop's poll, the WAL thread's fsync) do not count, the Python CPU
    does. Its top self-time frames go to stderr."""
    if out is None:
        yield
        return
    cmd = [str(bin_dir / "py-spy"), "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", "200", "--nonblocking", "--gil"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        proc.wait(timeout=60)
    self_samples: dict[str, int] = {}
    for line in out.read_text().splitlines():  # "frame;frame;...;leaf count"
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        self_samples[leaf] = self_samples.get(leaf, 0) + int(count)
    total = sum(self_samples.values()) or 1
    top = sorted(self_samples.items(), key=lambda kv: -kv[1])[:15]
    log(f"profile {out.name}: {total} samples; top self time:\n" + "\n".join(f"  {100 * n / total:5.1f}%  {f}" for f, n in top))


@contextmanager
def running_router(exe: Path, worker_url: str, port: int, log_file: Path) -> Iterator[tuple[str, int]]:
    """vllm-router in front of one engine, round robin; yields (base URL, pid) once it answers /health."""
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker_url, "--policy", "round_robin"]
    with open(log_file, "w") as out:
        proc = subprocess.Popen(cmd + ["--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 120, "vllm-router", proc, str(log_file))
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass
class Side:
    name: str  # direct | router | tidal
    url: str  # its /v1/completions
    headers: dict
    model: str  # the name this side routes by
    pid: int | None  # the proxy process whose CPU is counted (None: the engine itself)

    def body(self, i: int, max_tokens: int, stream: bool) -> dict:
        b = {"model": self.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        if self.name == "tidal":  # the gateway adds log-probs and token ids itself
            return {**b, "user": f"u{i % 64}", "stream": stream}
        return {**b, "logprobs": 0, "return_token_ids": True, "stream": stream}


@dataclass
class Load:
    latencies_ms: list[float] = field(default_factory=list)
    ttfb_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    n: int = 0

    def add(self, other: Load) -> None:
        self.latencies_ms += other.latencies_ms
        self.ttfb_ms += other.ttfb_ms
        self.wall_s, self.cpu_s, self.n = self.wall_s + other.wall_s, self.cpu_s + other.cpu_s, self.n + other.n

    @property
    def rps(self) -> float:
        return self.n / self.wall_s


def cpu_s(pid: int | None) -> float:
    """User + system seconds of pid and its descendants (0 for the engine side, which has no proxy)."""
    if pid is None:
        return 0.0
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


async def timed_request(session: aiohttp.ClientSession, side: Side, i: int, max_tokens: int, stream: bool, load: Load) -> None:
    """Request i on one side; its latency to the last byte into `load`, and to the first token when streamed."""
    t0 = time.perf_counter()
    async with session.post(side.url, json=side.body(i, max_tokens, stream)) as r:
        if r.status != 200:
            raise RuntimeError(f"{side.name} {side.url} -> {r.status}: {await r.text()}")
        if stream:
            await first_token(r.content)
            load.ttfb_ms.append((time.perf_counter() - t0) * 1000)
        await r.read()
    load.latencies_ms.append((time.perf_counter() - t0) * 1000)


async def run_load(side: Side, concurrency: int, n: int, max_tokens: int, stream: bool) -> Load:
    """n requests from `concurrency` workers on one side; latencies to the last byte, and to the first when streamed."""
    load, counter = Load(n=n), iter(range(n))
    async with aiohttp.ClientSession(headers=side.headers, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            for i in counter:
                await timed_request(session, side, i, max_tokens, stream, load)

        cpu0, t0 = cpu_s(side.pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        load.wall_s, load.cpu_s = time.perf_counter() - t0, cpu_s(side.pid) - cpu0
    return load


async def run_interleaved(sides: list[Side], n: int, max_tokens: int, stream: bool) -> dict[str, Load]:
    """Concurrency 1, the sides taking turns request by request (the order rotating), so that the engine's drift on
    a shared machine (up to 30% between consecutive runs of the same side, in vLLM's own request timings) hits
    every side alike: a difference of one millisecond is then visible. A side's wall time is the sum of its own
    requests' times."""
    loads = {s.name: Load(n=n) for s in sides}
    sessions = {s.name: aiohttp.ClientSession(headers=s.headers) for s in sides}
    cpu0 = {s.name: cpu_s(s.pid) for s in sides}
    try:
        for i in range(n):
            for s in sides[i % len(sides) :] + sides[: i % len(sides)]:
                await timed_request(sessions[s.name], s, i, max_tokens, stream, loads[s.name])
                loads[s.name].wall_s += loads[s.name].latencies_ms[-1] / 1000
    finally:
        for session in sessions.values():
            await session.close()
    for s in sides:  # each proxy idles while the others serve: its CPU over the whole run is its requests'
        loads[s.name].cpu_s = cpu_s(s.pid) - cpu0[s.name]
    return loads


async def first_token(content: aiohttp.StreamReader) -> None:
    """Read a completion stream up to its first event carrying text: the time to the first token (a proxy that
    sends its headers or an empty event early does not count as having answered)."""
    async for line in content:  # server-sent events, one `data: {...}` line each
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                return


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def measure_level(sides: list[Side], c: int, n: int, rounds: int, max_tokens: int) -> dict:
    """One concurrency level: warm-up, `rounds` interleaved rounds (the order rotates, so drift on a shared machine
    hits every side alike), then streamed rounds for the time to first byte. At concurrency 1 the sides take turns
    request by request (run_interleaved)."""
    for side in sides:
        await run_load(side, c, min(n, 4 * c), max_tokens, stream=False)
    plain = {s.name: Load() for s in sides}
    streamed = {s.name: Load() for s in sides}
    round_ratios = []
    for r in range(rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        if c == 1:
            this = await run_interleaved(order, n, max_tokens, stream=False)
        else:
            this = {s.name: await run_load(s, c, n, max_tokens, stream=False) for s in order}
        round_ratios.append(round(this["tidal"].rps / this["router"].rps, 3))
        for name, load in this.items():
            plain[name].add(load)
        if c == 1:
            for name, load in (await run_interleaved(order, max(c, n // 2), max_tokens, stream=True)).items():
                streamed[name].add(load)
        else:
            for s in order:
                streamed[s.name].add(await run_load(s, c, max(c, n // 2), max_tokens, stream=True))
    p50 = {k: round(pct(v.latencies_ms, 50), 2) for k, v in plain.items()}
    ttfb = {k: round(pct(v.ttfb_ms, 50), 2) for k, v in streamed.items()}
    return {
        **{f"{k}_rps": round(v.rps, 1) for k, v in plain.items()},
        "ratio_vs_router": round(plain["tidal"].rps / plain["router"].rps, 3),
        "ratio_vs_router_rounds": round_ratios,
        "p50_ms": p50,
        "p99_ms": {k: round(pct(v.latencies_ms, 99), 2) for k, v in plain.items()},
        "added_p50_vs_router_ms": round(p50["tidal"] - p50["router"], 2),
        "ttfb_p50_ms": ttfb,
        "ttfb_added_vs_router_ms": round(ttfb["tidal"] - ttfb["router"], 2),
        "cpu_ms_per_request": {k: round(1000 * plain[k].cpu_s / plain[k].n, 3) for k in ("router", "tidal")},
        "cpu_ms_per_streamed_request": {k: round(1000 * streamed[k].cpu_s / streamed[k].n, 3) for k in ("router", "tidal")},
    }


def targets(by_c: dict) -> dict:
    """The issue's bounds, read off this run's figures."""

    def at(c: int, key: str):
        return by_c.get(str(c), {}).get(key)

    rows = {
        "ratio_vs_router_c16": (at(16, "ratio_vs_router"), ">=", 0.95),
        "ratio_vs_router_c64": (at(64, "ratio_vs_router"), ">=", 0.95),
        "added_p50_vs_router_c1_ms": (at(1, "added_p50_vs_router_ms"), "<=", 1.0),
        "tidal_cpu_ms_per_completion_c64": ((at(64, "cpu_ms_per_request") or {}).get("tidal"), "<=", 0.25),
        "ttfb_added_vs_router_max_ms": (max((v["ttfb_added_vs_router_ms"] for v in by_c.values()), default=None), "<=", 1.0),
    }
    return {
        k: {"value": v, "bound": f"{op} {b}", "met": None if v is None else (v >= b if op == ">=" else v <= b)}
        for k, (v, op, b) in rows.items()
    }


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid and its descendants (affinity is per thread on Linux)."""
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, PermissionError):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per side, round and level (c=1: at most 100)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--isolate", action="store_true", help="give the engine CPU 0 to itself, every other process the rest")
    ap.add_argument("--profile", type=Path, help="a folder: py-spy samples the gateway at each level (gateway-c<N>.txt)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    bin_dir = ensure_bench_env()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    # The log sink as deployed (LogSinkSettings defaults), not the sandbox's quick uploads for tests.
    logsink = LogSinkSettings().model_dump(mode="json")
    with sandbox_platform(
        [{"name": "tab", "replicas": 1}], pretrain_seconds=20, gateway=True, gateway_settings={"logsink": logsink}
    ) as (settings, platform):
        (replica,) = platform.fleet_client().replicas("tab")
        served = next(iter(replica.served))
        g = settings.gateway
        time.sleep(2 * g.fleet_poll_s)  # the gateway has seen the replica
        with running_router(
            bin_dir / "vllm-router",
            replica.url,
            settings.prefect.port + SPARE,
            settings.log_dir / "vllm-router.log",  # a spare port
        ) as (router_url, router_pid):
            sides = [
                Side("direct", replica.url + "/v1/completions", {}, served, None),
                Side("router", router_url + "/v1/completions", {}, served, router_pid),
                Side(
                    "tidal",
                    f"http://{g.host}:{g.port}/v1/completions",
                    {"Authorization": f"Bearer {g.clients[0].key}"},
                    "tab",
                    platform.running("gateway").pid,
                ),
            ]
            if args.isolate and (os.cpu_count() or 1) >= 2:
                others = set(range(1, os.cpu_count()))
                for pid in (platform.running("gateway").pid, router_pid, os.getpid()):
                    pin(pid, others)
                pin(replica.pid, {0})
            by_c = {}
            for c in levels:
                n = min(args.requests, 100) if c == 1 else args.requests
                out = args.profile / f"gateway-c{c}.txt" if args.profile else None
                with profiled(bin_dir, platform.running("gateway").pid, out):
                    by_c[str(c)] = asyncio.run(measure_level(sides, c, n, args.rounds, args.max_tokens))
                log(f"concurrency {c}: {json.dumps(by_c[str(c)])}")
    print(
        json.dumps(
            {
                "by_concurrency": by_c,
                "targets": targets(by_c),
                "cpus": os.cpu_count(),
                "engine_cpu_isolated": bool(args.isolate),
                "max_tokens": args.max_tokens,
                "requests": args.requests,
                "rounds": args.rounds,
                "router": f"vllm-router {ROUTER_VERSION}",
                "logsink": {k: logsink[k] for k in ("segment_max_age_s", "upload_interval_s", "commit_interval_ms")},
            }
        )
    )


if __name__ == "__main__":
    main()
