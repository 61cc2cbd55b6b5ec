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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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


@contextmanager
def reporting(status: Callable[[], str], every_s: float = 2.0, progress: Progress | None = None) -> Iterator[None]:
    """Report `status()` every `every_s` from a background thread while the block runs in this one (a Prefect flow
    keeps its thread, and Ctrl-C its usual effect). A status that fails is shown as such and asked again next time."""
    progress, stop, start = progress or Progress(), threading.Event(), time.monotonic()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                text = status()
            except Exception as e:  # noqa: BLE001  the server busy with the call, say
                text = f"(status unavailable: {type(e).__name__})"
            if not stop.is_set():
                progress.update(time.monotonic() - start, text)

    reporter = threading.Thread(target=loop, name="progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join(timeout=every_s + 5)
        progress.close()


def with_progress(call: Callable[[], T], status: Callable[[], str], every_s: float = 2.0, progress: Progress | None = None) -> T:
    """`call()` (blocking), with `status()` reported while it runs; its result or error is call's."""
    with reporting(status, every_s, progress):
        return call()


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


def log_status(path: Path, starts: tuple[str, ...], idle: str) -> Callable[[], str]:
    """A status that is the last line starting with one of `starts` written to `path` since this call (a log that
    another process appends to, e.g. the trainer's `iteration 3/20 (41 s, ~120 s left): ...`), else `idle`."""
    offset = path.stat().st_size if path.exists() else 0
    last = idle

    def status() -> str:
        nonlocal last
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith(starts):
                        last = line.strip()[:160]
        return last

    return status
