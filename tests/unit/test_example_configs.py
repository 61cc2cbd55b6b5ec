"""The example settings files (infra/examples/) load as they are, placeholders filled, and say what their comments
claim: a GPU host that imports its model and leaves the trainer part of the GPU; an AWS installation on the
supervisor, Kubernetes trainer Jobs and the Terraform stack's buckets and services."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.unit.terraform_hcl import TF
from tidal.settings import TidalSettings, load_settings

EXAMPLES = Path(__file__).resolve().parents[2] / "infra" / "examples"


def load_example(name: str, tmp_path: Path, monkeypatch) -> TidalSettings:
    text = (EXAMPLES / name).read_text().replace("<prefix>", "acme-tidal").replace("<account>", "123456789012")
    path = tmp_path / name
    path.write_text(text.replace("/var/lib/tidal", str(tmp_path / "state")))
    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    return load_settings()


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.tidal.yaml")))
def test_every_example_loads(name, tmp_path, monkeypatch):
    settings = load_example(name, tmp_path, monkeypatch)
    assert settings.models and settings.engine.flavor == "cuda"


def test_the_single_gpu_host_imports_its_model_and_shares_the_gpu(tmp_path, monkeypatch):
    s = load_example("single-gpu.tidal.yaml", tmp_path, monkeypatch)
    [tab] = s.models
    assert tab.checkpoint and tab.update_strategy == "lora" and s.train.ppo.lora
    assert s.fleet.runtime == "local" and s.trainer.launcher == "local"
    util = s.engine.extra_args[s.engine.extra_args.index("--gpu-memory-utilization") + 1]
    assert float(util) <= 0.5  # the trainer's share of the one GPU
    assert s.engine.max_lora_rank >= s.train.ppo.lora_rank and s.collect.max_model_len >= s.engine.max_model_len


def test_the_aws_example_matches_the_terraform_stack(tmp_path, monkeypatch):
    s = load_example("aws.tidal.yaml", tmp_path, monkeypatch)
    assert s.fleet.runtime == "kubernetes" and s.trainer.launcher == "kubernetes" and s.flywheel.work_pool
    assert set(s.fleet.kubernetes.models) == {m.name for m in s.models}
    tidal_tf = (TF / "modules" / "platform" / "tidal.tf").read_text()
    for area in s.store.routes:  # the same areas routed to their own buckets
        assert re.search(rf'"?{re.escape(area)}"?\s*= "s3://', tidal_tf), area
    assert "port = 4200" in tidal_tf and "port = 80" in tidal_tf and "admin_port = 8090" in tidal_tf
    assert s.prefect.port == 4200 and s.mlflow.port == 80 and s.fleet.admin_port == 8090
    # the trainers push to the chart's Pushgateway, which the stack enables, at the address the chart gives it
    assert re.search(r"pushgateway\s*= \{ enabled = true \}", tidal_tf)
    helpers = (EXAMPLES.parent / "helm" / "tidal" / "templates" / "_helpers.tpl").read_text()
    assert '"http://tidal-pushgateway.%s.svc:9091" .Release.Namespace' in helpers
    assert s.prometheus.pushgateway_url == "http://tidal-pushgateway.tidal.svc:9091"
