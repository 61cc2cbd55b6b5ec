"""A training run asked to give its capacity back: SIGTERM stops it at the next iteration boundary.

Who sends it: the local launcher when the run's lease is revoked (tasks/train.py), Kubernetes when it evicts the
trainer's pod for a pod of higher priority (serving). The signal handler only raises a flag, so the iteration in
progress finishes; that iteration is then checkpointed whatever `train.checkpoint_every` says, and the process
exits EXIT_PREEMPTED. The next attempt resumes from that checkpoint and ends with the weights an uninterrupted run
reaches, bit for bit (tests/unit/test_preemption.py). A trainer that does not reach the boundary within the
launcher's grace period is killed; it then resumes from its last periodic checkpoint, as after any crash.

Several processes (torchrun forwards the signal to each): rank 0's flag is broadcast after every iteration, so
all ranks stop after the same one and write one checkpoint.
"""

from __future__ import annotations

import signal
from types import FrameType

from training.job_spec import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "Preempted", "StopRequest"]


class Preempted(Exception):
    """Raised by the run's progress hook after `iteration` was checkpointed on a stop request."""

    def __init__(self, iteration: int):
        super().__init__(f"preempted after iteration {iteration + 1}: checkpointed, resumes from there")
        self.iteration = iteration


class StopRequest:
    """`with StopRequest() as stop:` SIGTERM sets `stop.requested` instead of ending the process (main thread
    only, as every Python signal handler); the previous handler comes back on exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: signal.Handlers | None = None

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
