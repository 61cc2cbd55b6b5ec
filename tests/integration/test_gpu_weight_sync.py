"""`reload` and `nccl` on real CUDA vLLM engines: a fleet of two replicas on one GPU moves a canary in place,
rolls it back, promotes it, and refuses (rolling back) a version whose weights do not match its probe.

Needs a CUDA device and the CUDA engine environment (`./run.sh setup` with TIDAL_ENGINE_FLAVOR=cuda); `nccl`
also needs a second GPU for its sender (NCCL allows one rank per GPU in a group). No MLflow: the registry is
an in-memory stand-in; the engines, the strategies and the probes are the real ones.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.gpu_check import tiny_versions
from serving.fleet import Fleet
from serving.probe import ProbeFailed
from serving.settings import EngineSettings, FleetSettings
from tidal.model_settings import ModelSettings
from tidal.registry import CheckpointCache, VersionInfo, checkpoint_key
from tidal.sandbox import port_block
from tidal.settings import TidalSettings
from tidal.store import open_store
from training.variants import noisy_copy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


class MemoryRegistry:
    """What the fleet reads of the registry, for versions placed in the store by the test."""

    def __init__(self, model: str, versions: list[int]):
        self.versions = {n: VersionInfo(model, n, "full", n, "") for n in versions}

    def by_alias(self, model: str, alias: str) -> VersionInfo | None:
        return self.versions[1] if alias == "champion" else None

    def get(self, model: str, version: int) -> VersionInfo:
        return self.versions[version]

    def resolve(self, model: str, ref) -> VersionInfo:
        return self.versions[int(str(ref).lstrip("v"))]


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory) -> dict[int, Path]:
    """v1, v2 (a noisy copy) and v3 (other weights registered with v2's probe: wrong weights)."""
    work = tmp_path_factory.mktemp("gpu-weights")
    v1, v2 = tiny_versions(work, pretrain_s=10.0)
    v3 = noisy_copy(v1, work / "v3", seed=9, noise=0.05)
    shutil.copy(v2 / "probe.json", v3 / "probe.json")
    return {1: v1, 2: v2, 3: v3}


@pytest.fixture(params=["reload", "nccl"])
def fleet(request, tmp_path, checkpoints_dir, monkeypatch):
    strategy = request.param
    if strategy == "nccl" and gpu_count() < 2:
        pytest.skip("nccl needs a second GPU for its sender: NCCL allows one rank per GPU in a group")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the engines; the nccl sender gets GPU 1
    model = f"g{strategy}"
    settings = TidalSettings(
        data_dir=tmp_path / "data",
        models=[ModelSettings(name=model, replicas=1, update_strategy=strategy)],
        engine=EngineSettings(
            python=ROOT / ".engine-venv" / "bin" / "python",
            flavor="cuda",
            dtype="float32",
            extra_args=["--gpu-memory-utilization", "0.2"],
            nccl_sender_gpu="1",
            weight_update_timeout_s=120.0,
        ),
        fleet=FleetSettings(base_port=port_block() + 10, port_range=40, warmup_bursts=[], ready_timeout_s=300),
    )
    store = open_store(settings)
    for n, d in checkpoints_dir.items():
        shutil.copytree(d, store.root / checkpoint_key(model, n))
    f = Fleet(settings, MemoryRegistry(model, list(checkpoints_dir)), CheckpointCache(store, tmp_path / "cache"))
    try:
        f.add_model(settings.models[0])
        f.scale(model, 2)  # one at a time: engines profiling GPU memory side by side misjudge what is free
        yield f, model
    finally:
        f.stop()


def served(f: Fleet, model: str) -> list[dict[str, int]]:
    return [r.served() for r in sorted(f.group(model).replicas, key=lambda r: r.index) if r.state == "ready"]


def greedy(f: Fleet, model: str, name: str) -> list[list[int]]:
    """Every ready replica serving `name` answers it (the engine accepts a version it moved to)."""
    out = []
    for r in f.group(model).ready_replicas():
        if name in r.served():
            body = {"model": name, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            resp = httpx.post(f"{r.url}/v1/completions", json=body, timeout=60)
            resp.raise_for_status()
            out.append(resp.json()["choices"][0]["token_ids"])
    return out


def test_canary_rollback_promotion_and_wrong_weights(fleet):
    f, model = fleet
    v1, v2 = f"{model}@v1", f"{model}@v2"
    assert served(f, model) == [{v1: 1}, {v1: 1}]

    reports = f.deploy(model, 2)  # a canary: the newest replica moves, the other keeps the champion
    assert [r.ok for r in reports] == [True]
    assert served(f, model) == [{v1: 1}, {v2: 2}] and sorted(f.group(model).surge) == [2]
    assert greedy(f, model, v2) and greedy(f, model, v1)

    f.undeploy(model, 2)  # rollback: back to v1 in place, verified
    assert served(f, model) == [{v1: 1}, {v1: 1}]

    f.deploy(model, 2)
    f.undeploy(model, 1)  # promotion: the other replica moves too
    assert served(f, model) == [{v2: 2}, {v2: 2}] and f.group(model).base.version == 2

    with pytest.raises(ProbeFailed, match=f"probe FAIL for {model}@v3(.|\n)*rolled back to {v2} and verified"):
        f.deploy(model, 3)
    assert served(f, model) == [{v2: 2}, {v2: 2}]
    assert not f.group(model).surge
