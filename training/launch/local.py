"""The trainer as a subprocess of the flow, on this machine: the default, and what `tidal demo` runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from tidal.section import PROJECT_ROOT
from training.launch.base import StopSignal, TrainerLauncher, note

if TYPE_CHECKING:
    from training.job_spec import TrainJob


POLL_S = 0.2  # how often a stop request is looked for while the trainer runs


class LocalLauncher(TrainerLauncher):
    name = "local"

    def __init__(self, processes: int = 1):
        self.processes = processes

    def command(self, command: str, spec_path: Path) -> list[str]:
        job = ["-m", "training.job", command, str(spec_path)]
        if self.processes == 1:
            return [sys.executable, *job]
        # torchrun of the flow's own interpreter (torch.distributed.run is what the `torchrun` script calls)
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(self.processes),
            *job,
        ]

    def _run(self, command: str, spec: TrainJob, spec_path: Path, log: BinaryIO, stop: StopSignal | None) -> int:
        # Same interpreter as the flow; a kill -9 of the trainer shows here as a negative code (a crash, retried).
        # Under torchrun any failed process makes the job exit 1: a bad input or divergence is then retried as a
        # crash (each retry fails the same way), since torchrun does not pass a worker's own exit code on; it
        # forwards SIGTERM to its workers.
        proc = subprocess.Popen(
            self.command(command, spec_path), cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        asked = None  # when SIGTERM was sent
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if stop is None or not stop.event.is_set():
                continue
            if asked is None:
                note(log, f"stop requested: SIGTERM to the trainer (pid {proc.pid}), a kill after {stop.grace_s:g} s")
                proc.send_signal(signal.SIGTERM)
                asked = time.monotonic()
            elif time.monotonic() - asked > stop.grace_s:
                note(log, f"the trainer still ran {stop.grace_s:g} s after SIGTERM: killed; it resumes from its last checkpoint")
                proc.kill()
                return proc.wait()
