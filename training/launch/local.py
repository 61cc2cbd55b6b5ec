"""The trainer as a subprocess of the flow, on this machine: the default, and what `tidal demo` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from tidal.settings import PROJECT_ROOT
from training.launch.base import TrainerLauncher

if TYPE_CHECKING:
    from training.job_spec import TrainJob


class LocalLauncher(TrainerLauncher):
    name = "local"

    def _run(self, command: str, spec: TrainJob, spec_path: Path, log: BinaryIO) -> int:
        # Same interpreter as the flow; a kill -9 of the trainer shows here as a negative code (a crash, retried).
        proc = subprocess.run([sys.executable, "-m", "training.job", command, str(spec_path)], cwd=PROJECT_ROOT,
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
        return proc.returncode
