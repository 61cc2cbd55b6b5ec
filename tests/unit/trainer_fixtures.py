"""What the trainer launchers' unit tests share: a clean environment and a TrainJob to launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from training.job_spec import TrainJob
from training.launch.local import LocalLauncher
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


class StandIn(LocalLauncher):
    """The local launcher running a stand-in for `python -m training.job` (a script): what is tested is how the
    launcher stops a process, the stop itself being training/preemption.py's (tests/unit/test_preemption.py)."""

    def __init__(self, script: str):
        super().__init__()
        self.script = script

    def command(self, command: str, spec_path: Path) -> list[str]:
        return [sys.executable, "-c", self.script, str(spec_path.parent / "ready")]


# a trainer between iterations: it stops at SIGTERM, as training.job does, with the real StopRequest
STOPS = """import sys, time, pathlib
from training.preemption import EXIT_PREEMPTED, StopRequest
with StopRequest() as stop:
    pathlib.Path(sys.argv[1]).touch()
    while not stop.requested:
        time.sleep(0.02)
print("stop requested; checkpointed, exiting", EXIT_PREEMPTED, flush=True)
sys.exit(EXIT_PREEMPTED)
"""
# a trainer stuck in an iteration that outlasts the grace period
STUCK = """import signal, sys, time, pathlib
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""
# a run preempted once: the first attempt stops at SIGTERM, the next (resumed from its checkpoint) finishes
RESUMES = """import sys, time, pathlib
from training.preemption import EXIT_PREEMPTED, StopRequest
ready = pathlib.Path(sys.argv[1])
if ready.exists():
    print("resuming after iteration 2 of 4; finished", flush=True)
    sys.exit(0)
with StopRequest() as stop:
    ready.touch()
    while not stop.requested:
        time.sleep(0.02)
sys.exit(EXIT_PREEMPTED)
"""
