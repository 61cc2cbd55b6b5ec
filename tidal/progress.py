"""Progress of a long blocking command: what it waits on, while it waits.

On a terminal one status line is rewritten in place; elsewhere (CI logs, pipes) a plain line is printed each time
the status changes, so a log shows every transition and no spinner noise.

    with_progress(lambda: client.deploy("tab", "7"), lambda: replica_summary(client, "tab"))
    [12 s] tab-0 ready [tab@v1, tab@v7] · tab-1 starting [tab@v1]
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO, TypeVar

T = TypeVar("T")


class Progress:
    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last, self._width = "", 0

    def update(self, elapsed_s: float, status: str) -> None:
        if self.tty:
            line = f"[{elapsed_s:4.0f} s] {status}"
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif status != self._last:
            self.stream.write(f"[{elapsed_s:.0f} s] {status}\n")
        self._last = status
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def with_progress(call: Callable[[], T], status: Callable[[], str], every_s: float = 2.0, progress: Progress | None = None) -> T:
    """Run `call` (blocking) and report `status()` every `every_s` until it returns; its result or error is call's.
    A status that fails (the server busy with the call) is shown as such and asked again next time."""
    progress = progress or Progress()
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001  re-raised in the caller's thread
            out["error"] = e

    worker = threading.Thread(target=run, name="long-command", daemon=True)
    start = time.monotonic()
    worker.start()
    try:
        while True:
            worker.join(timeout=every_s)
            if not worker.is_alive():
                break
            try:
                text = status()
            except Exception as e:  # noqa: BLE001
                text = f"(status unavailable: {type(e).__name__})"
            progress.update(time.monotonic() - start, text)
    finally:
        progress.close()
    if "error" in out:
        raise out["error"]
    return out["value"]


def replica_summary(status, model: str) -> str:
    """One line of a model's replicas from a FleetStatus: name, state, what each serves, restarts when any."""
    group = status.models.get(model)
    if group is None:
        return f"{model}: not in the fleet yet"
    parts = [
        f"{r.name} {r.state} [{', '.join(sorted(r.served))}]" + (f" restarts={r.restarts}" if r.restarts else "")
        for r in group.replicas
    ]
    return f"{model} {len(group.replicas)}/{group.desired_replicas}: " + (" · ".join(parts) or "no replicas")
