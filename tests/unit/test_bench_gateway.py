"""bench/gateway.py's fairness and its reading of the targets: every side asks the engine for the same work, and a
target is met or missed by the run's own figures."""

from __future__ import annotations

import os

import pytest

from bench import gateway


def test_every_side_asks_the_engine_for_the_same_work():
    direct = gateway.Side("direct", "http://e/v1/completions", {}, "tab@v1", None)
    router = gateway.Side("router", "http://r/v1/completions", {}, "tab@v1", 1)
    tidal = gateway.Side("tidal", "http://g/v1/completions", {"Authorization": "Bearer k"}, "tab", 2)
    d, r, t = (s.body(5, 16, stream=True) for s in (direct, router, tidal))
    assert d == r and d["logprobs"] == 0 and d["return_token_ids"] is True  # what the gateway asks the engine for
    assert {k: t[k] for k in ("prompt", "max_tokens", "temperature", "stream")} == {
        k: d[k] for k in ("prompt", "max_tokens", "temperature", "stream")
    }
    assert t["temperature"] == 0 and t["model"] == "tab" and "logprobs" not in t  # greedy: no seeds (design.md)
    assert direct.body(5, 16, False)["prompt"] != direct.body(6, 16, False)["prompt"]  # prompts vary with the index


def test_targets_read_the_runs_figures():
    level = {
        "ratio_vs_router": 0.97,
        "added_p50_vs_router_ms": 0.4,
        "ttfb_added_vs_router_ms": 2.5,
        "cpu_ms_per_request": {"router": 0.05, "tidal": 0.3},
    }
    t = gateway.targets({"1": level, "16": {**level, "ratio_vs_router": 0.9}, "64": level})
    assert t["ratio_vs_router_c64"] == {"value": 0.97, "bound": ">= 0.95", "met": True}
    assert t["ratio_vs_router_c16"]["met"] is False and t["added_p50_vs_router_c1_ms"]["met"] is True
    assert t["tidal_cpu_ms_per_completion_c64"] == {"value": 0.3, "bound": "<= 0.25", "met": False}
    assert t["ttfb_added_vs_router_max_ms"]["met"] is False
    # a level not run gives no verdict rather than a pass
    assert gateway.targets({"1": level})["ratio_vs_router_c64"] == {"value": None, "bound": ">= 0.95", "met": None}


def test_the_proxy_cpu_counts_the_process_and_none_for_the_engine_side():
    assert gateway.cpu_s(None) == 0.0
    assert gateway.cpu_s(os.getpid()) > 0


def test_the_first_token_is_the_first_event_with_text():
    import asyncio

    read = []

    async def stream():
        for line in [b": keep-alive\n", b'data: {"choices": [{"text": ""}]}\n', b'data: {"choices": [{"text": "x"}]}\n', b"rest"]:
            read.append(line)
            yield line

    asyncio.run(gateway.first_token(stream()))
    assert read[-1] == b'data: {"choices": [{"text": "x"}]}\n'  # stopped there: an empty event is no answer


def test_at_concurrency_1_the_sides_take_turns_request_by_request():
    import asyncio

    from aiohttp import web

    seen: list[str] = []

    async def main() -> dict:
        runners, sides = [], []
        for name in ("direct", "router", "tidal"):

            async def answer(request, name=name):
                seen.append(name)
                return web.json_response({"choices": [{"text": "x"}]})

            app = web.Application()
            app.router.add_post("/v1/completions", answer)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            port = runner.addresses[0][1]
            sides.append(gateway.Side(name, f"http://127.0.0.1:{port}/v1/completions", {}, "tab", None))
        try:
            return await gateway.run_interleaved(sides, 4, 16, stream=False)
        finally:
            for runner in runners:
                await runner.cleanup()

    loads = asyncio.run(main())
    assert seen[:6] == ["direct", "router", "tidal", "router", "tidal", "direct"]  # the order rotates each turn
    assert {name: (load.n, len(load.latencies_ms)) for name, load in loads.items()} == {
        name: (4, 4) for name in ("direct", "router", "tidal")
    }
    assert all(load.wall_s == pytest.approx(sum(load.latencies_ms) / 1000) for load in loads.values())
