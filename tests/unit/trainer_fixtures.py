"""What the trainer launchers' unit tests share: a clean environment and a TrainJob to launch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from training.job_spec import TrainJob
from training.train_settings import TrainSettings

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/tidal:0.1.0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in list(os.environ):
        if name.startswith("TIDAL_") or name == "WORLD_SIZE":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def spec(model: str = "tab") -> TrainJob:
    return TrainJob(
        model=model,
        run_key="run-0123456789abcdef",
        dataset_id="ds-1",
        dataset_digest="sha256:" + "0" * 64,
        champion_version=1,
        tracking_uri="http://tidal-mlflow",
        mlflow_run_id="r1",
        train=TrainSettings(),
        corpus_heldout_fraction=0.1,
        torch_threads=1,
    )
