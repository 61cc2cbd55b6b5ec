"""The interface every trainer launcher implements: run `python -m training.job <command> <spec>` to
completion, append what it printed to the model's train log, return its exit code.

Exit codes are the trainer's own (training/job_spec.py: 0, EXIT_BAD_INPUT, EXIT_DIVERGED, anything else a
crash), so tasks/train.py maps them to TrainerRejected/TrainerCrashed the same way wherever the trainer ran.
A launcher adds one code of its own, EXIT_NOT_RUN, for a trainer that never ran to its end (not scheduled,
image not pulled, deadline passed): a crash, retried, with the reason written to the train log.

A run may be asked to give its capacity back (its lease revoked): `run(..., stop=StopSignal(event, grace_s))`.
Once `event` is set the launcher asks the trainer to stop (SIGTERM: it checkpoints the iteration in progress and
exits EXIT_PREEMPTED, training/preemption.py) and kills it if it still runs grace_s later.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from training.job_spec import TrainJob

EXIT_NOT_RUN = 125  # as `docker run`: the command itself never completed (the trainer's codes are 0..3 or signals)
STORE_REF = "store:"  # `python -m training.job train store:<key>` reads the spec from the object store
SPEC_FILE = "spec.json"


class LaunchError(RuntimeError):
    """The launcher could not start the trainer at all (credentials, permissions, a refused manifest); the message
    names the fix. Not retried: the next attempt would be refused the same way."""


@dataclass(frozen=True)
class StopSignal:
    """Set `event` to stop a running trainer: SIGTERM at once, a kill if it still runs `grace_s` later."""

    event: threading.Event
    grace_s: float


def spec_key(spec: TrainJob) -> str:
    """Where a launcher whose trainer cannot read this machine's disk puts the spec: beside the run's other files."""
    return f"{spec.prefix}/{SPEC_FILE}"


def note(log: BinaryIO, line: str) -> None:
    """A launcher's own line in the train log (prefixed, so it reads apart from the trainer's output)."""
    log.write(f"[launcher] {line}\n".encode())
    log.flush()


class TrainerLauncher(ABC):
    name: str = ""

    def run(self, command: str, spec: TrainJob, spec_path: Path, log_path: Path, stop: StopSignal | None = None) -> int:
        """Run `python -m training.job <command>` on the spec written at spec_path, to completion or until `stop`
        ends it; its output is appended to log_path. Returns the trainer's exit code (or EXIT_NOT_RUN)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"--- {command} {spec.run_key}\n".encode())
            log.flush()
            return self._run(command, spec, spec_path, log, stop)

    @abstractmethod
    def _run(self, command: str, spec: TrainJob, spec_path: Path, log: BinaryIO, stop: StopSignal | None) -> int:
        """Launch and wait; everything the trainer prints goes to `log` (opened for appending, binary)."""
