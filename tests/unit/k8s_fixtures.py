"""What the Kubernetes runtime's unit tests share: a clean environment, Kubernetes-runtime settings, and the
kubernetes client's own models to check a manifest against."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from kubernetes import client as k8s

from tidal.settings import load_settings

VLLM = "vllm/vllm-openai:v0.32.0"
TIDAL = "123456789012.dkr.ecr.us-east-1.amazonaws.com/tidal:0.1.0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def settings(tmp_path: Path, models: list[dict] | None = None, flavor: str = "cuda", **cfg):
    return load_settings(
        data_dir=str(tmp_path / ".tidal"),
        store={"url": "s3://b/t"},
        mlflow={"host": "tidal-mlflow"},
        engine={"flavor": flavor, "dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": False},
        collect={"max_model_len": 4096},
        fleet={
            "runtime": "kubernetes",
            "warmup_bursts": [],
            "restart_backoff_s": 0,
            "kubernetes": {"image": VLLM, "weights_image": TIDAL, **cfg},
        },
        models=models or [{"name": "tab", "replicas": 2, "update_strategy": "lora"}],
    )


def as_model(manifest: dict, kind: str):
    """What the client makes of a manifest: a typed model (wrong types raise), unknown keys dropped."""
    return k8s.ApiClient()._ApiClient__deserialize(copy.deepcopy(manifest), kind)


def round_trips(manifest: dict, kind: str) -> bool:
    """Equal after model and back: every key is a real field of `kind` (a misspelt key would vanish)."""
    return k8s.ApiClient().sanitize_for_serialization(as_model(manifest, kind)) == manifest
