"""The fleet against real vLLM replicas, real MLflow and Prefect servers (tests run in file order)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil
import pytest

from data_contracts import corpus
from serving.client import FleetError
from serving.replica import Replica, boot
from tidal.procs import NotReady, PortInUse, port_free
from tidal.registry import publish
from training.variants import noisy_copy, random_adapter

pytestmark = pytest.mark.slow


def complete(url: str, model: str, prompt: str = "def add(a, b):\n    return", max_tokens: int = 8) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]


def served_models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def wait_for(pred, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def byte_entropy(texts: list[str]) -> float:
    """Bits/byte of the byte frequencies alone (the best a model that ignores context can do; ~4.6 on the stdlib)."""
    data = "".join(texts).encode()
    counts = Counter(data)
    return -sum(c / len(data) * math.log2(c / len(data)) for c in counts.values())


def test_bootstrap_registers_v1_as_champion(registry, champion, settings):
    assert champion.version == 1 and champion.kind == "full"
    assert registry.aliases("tab")["champion"] == 1
    # The base learned context, not just which bytes are common: it beats the held-out code's byte entropy.
    root = corpus.stdlib_root()
    _, heldout = corpus.split_stdlib(settings.bootstrap.heldout_fraction, root)
    unigram = byte_entropy(corpus.read_texts(heldout[:200]))
    bpb = float(champion.tags["tidal.heldout_bits_per_byte"])
    assert bpb < unigram - 0.3, (bpb, unigram)


def test_fleet_serves_champion_on_two_replicas(fleet):
    replicas = fleet.replicas("tab")
    assert [r.state for r in replicas] == ["ready", "ready"]
    for r in replicas:
        assert r.served == {"tab@v1": 1}
        choice = complete(r.url, "tab@v1")
        assert choice["text"] and len(choice["token_ids"]) == 8
        lp = choice["logprobs"]["token_logprobs"]
        assert len(lp) == 8 and all(x <= 0 for x in lp)


def test_seeded_requests_whose_prompts_fill_a_step_do_not_crash_a_replica(fleet):
    # 32 seeded sampling requests at once, each with a prompt near max_model_len: with vLLM's chunked prefill on,
    # the CPU engine splits some of these prefills and dies rewinding their generators ("CPU Generator does not use
    # offset"); engine.chunked_prefill is off by default so that no request pattern can crash a replica.
    import concurrent.futures
    import inspect
    import json as json_module

    source = inspect.getsource(json_module)
    replica = fleet.replicas("tab")[0]

    def one(i: int) -> int:
        start = (i * 997) % (len(source) - 1000)
        body = {"model": "tab@v1", "prompt": source[start : start + 450], "max_tokens": 16, "temperature": 1.0, "seed": i}
        return httpx.post(f"{replica.url}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        codes = Counter(pool.map(one, range(64)))
    assert codes == {200: 64}, codes
    after = next(r for r in fleet.replicas("tab") if r.url == replica.url)
    assert (after.state, after.pid, after.restarts) == ("ready", replica.pid, replica.restarts), after


def test_scale_one_two_one(fleet):
    fleet.scale("tab", 1)
    replicas = fleet.replicas("tab")
    assert len(replicas) == 1 and replicas[0].state == "ready"
    # `tidal fleet scale` waits for the new replica's verification, printing the replicas' states meanwhile
    cli = subprocess.run([sys.executable, "-m", "tidal.cli", "fleet", "scale", "tab", "2"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert len(json.loads(cli.stdout)["replicas"]) == 2
    lines = [line for line in cli.stderr.splitlines() if line.startswith("[")]
    assert lines and all(" s] tab " in line for line in lines) and " starting [" in cli.stderr, cli.stderr
    replicas = fleet.replicas("tab")
    assert [r.state for r in replicas] == ["ready", "ready"]
    assert all(complete(r.url, "tab@v1")["text"] for r in replicas)
    gone = replicas[-1]
    fleet.scale("tab", 1)
    assert len(fleet.replicas("tab")) == 1
    assert wait_for(lambda: not psutil.pid_exists(gone.pid), 30, "the scaled-down engine to exit")


def test_lora_version_loads_verifies_and_unloads(fleet, registry, settings, checkpoints, champion, tmp_path):
    base_dir = checkpoints.local_dir(champion)
    adapter = random_adapter(base_dir, tmp_path / "adapter", seed=1)
    v = publish(registry, checkpoints.store, "tab", adapter, "lora", 1, {"tidal.parent_version": "1"})
    out = fleet.deploy("tab", v.version)
    assert len(out.probes) == 1 and "probe pass" in out.probes[0]
    (replica,) = fleet.replicas("tab")
    assert replica.served == {"tab@v1": 1, f"tab@v{v.version}": v.version}
    assert f"tab@v{v.version}" in served_models(replica.url)
    assert complete(replica.url, f"tab@v{v.version}")["token_ids"] != complete(replica.url, "tab@v1")["token_ids"]
    fleet.undeploy("tab", v.version)
    assert f"tab@v{v.version}" not in served_models(replica.url)
    assert fleet.replicas("tab")[0].served == {"tab@v1": 1}


def test_probe_rejects_wrong_weights(fleet, registry, checkpoints, champion, tmp_path):
    base_dir = checkpoints.local_dir(champion)
    honest = random_adapter(base_dir, tmp_path / "honest", seed=2)
    # Weights of seed 3 registered with the probe of seed 2: the registry record and the weights disagree.
    wrong = random_adapter(base_dir, tmp_path / "wrong", seed=3, probe_from=honest)
    v = publish(registry, checkpoints.store, "tab", wrong, "lora", 1, {"tidal.origin": "test: mismatched probe"})
    with pytest.raises(FleetError) as e:
        fleet.deploy("tab", v.version)
    assert e.value.status == 409 and "probe FAIL" in e.value.detail
    (replica,) = fleet.replicas("tab")
    assert f"tab@v{v.version}" not in served_models(replica.url)  # unverified weights never stay loaded
    assert replica.served == {"tab@v1": 1}


def test_restart_strategy_serves_a_canary_on_a_surge_replica_and_a_rollback_stops_it(
    fleet, registry, checkpoints, champion, tmp_path
):
    def by_version() -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in fleet.replicas("tabfull"):
            (version,) = r.served.values()
            out.setdefault(version, []).append(r)
        return out

    (old,) = fleet.replicas("tabfull")
    base_dir = checkpoints.local_dir(registry.get("tabfull", 1))
    variant = noisy_copy(base_dir, tmp_path / "full", seed=4)
    v = publish(registry, checkpoints.store, "tabfull", variant, "full", None, {"tidal.parent_version": "1"})
    name = f"tabfull@v{v.version}"

    # deploy: a surge replica on the candidate beside the champion's, which keeps serving
    out = fleet.deploy("tabfull", v.version)
    assert any("probe pass" in p for p in out.probes)
    now = by_version()
    assert [r.name for r in now[1]] == [old.name] and len(now[v.version]) == 1
    (surge,) = now[v.version]
    assert served_models(surge.url) == {name} and complete(surge.url, name)["text"]
    assert fleet.status().models["tabfull"].surge_versions == [v.version]

    # undeploy the candidate (a rollback): its replica stops, the champion's is untouched
    fleet.undeploy("tabfull", v.version)
    assert [r.name for r in fleet.replicas("tabfull")] == [old.name]
    assert wait_for(lambda: not psutil.pid_exists(surge.pid), 30, "the surge engine to exit")

    # The promotion half (retire the champion, the surge replica takes over) is
    # test_promote.py::test_restart_strategy_canary_runs_on_a_surge_replica_and_promotes, through the gate.


@pytest.mark.parametrize(
    "model, version, status, words",
    [
        ("tab", "99", 404, "no version 99"),
        ("nope", "1", 404, "unknown model"),
        ("tab", "@nosuchalias", 404, "no alias"),
    ],
)
def test_bad_deploys_are_refused_clearly(fleet, model, version, status, words):
    with pytest.raises(FleetError) as e:
        fleet.deploy(model, version)
    assert e.value.status == status and words in e.value.detail


def test_running_version_cannot_be_undeployed(fleet):
    base = fleet.status().models["tabfull"].base_version
    with pytest.raises(FleetError) as e:
        fleet.undeploy("tabfull", base)
    assert e.value.status == 400 and "what the replicas run" in e.value.detail


def test_lora_strategy_refuses_a_full_checkpoint(fleet):
    with pytest.raises(FleetError) as e:
        fleet.deploy("tab", "1")  # v1 is tab's full base: the lora strategy loads adapters only
    assert e.value.status == 400 and "adapters only" in e.value.detail


def test_missing_checkpoint_is_a_clear_error(fleet, registry, checkpoints, champion, tmp_path):
    adapter = random_adapter(checkpoints.local_dir(champion), tmp_path / "gone", seed=5)
    v = publish(registry, checkpoints.store, "tab", adapter, "lora", 1, {})
    for key in checkpoints.store.list(v.key + "/"):
        os.remove(checkpoints.store.root / key)
    with pytest.raises(FleetError) as e:
        fleet.deploy("tab", v.version)
    assert e.value.status == 404 and "missing" in e.value.detail


def test_replica_that_never_becomes_ready_is_killed(settings, champion, checkpoints):
    quick = settings.model_copy(update={"fleet": settings.fleet.model_copy(update={"ready_timeout_s": 3.0})})
    port = settings.fleet.base_port + settings.fleet.port_range - 1
    replica = Replica("tab", 99, port, "127.0.0.1", champion)
    with pytest.raises(NotReady) as e:
        boot(replica, quick, checkpoints, enable_lora=False)
    assert "not ready" in str(e.value) and replica.state == "failed"
    assert replica.proc is not None and replica.proc.poll() is not None
    assert port_free("127.0.0.1", port)


def test_occupied_port_is_reported(platform, settings):
    from tidal.platform import Platform

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        other = Platform(
            settings.model_copy(
                update={"prefect": settings.prefect.model_copy(update={"port": port}), "data_dir": settings.data_path / "other"}
            )
        )
        with pytest.raises(PortInUse) as e:
            other.ensure(other.services()["prefect"])
    assert f"127.0.0.1:{port}" in str(e.value) and "prefect.port" in str(e.value)
