"""Process plumbing shared by the platform and the fleet: ports, spawning, readiness, stopping."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil


class PortInUse(RuntimeError):
    pass


class NotReady(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick), for a short-lived server."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def wait_port_free(host: str, port: int, timeout: float) -> bool:
    """Until the port can be bound again (True) or `timeout` passes (False): a server's port outlives the
    group it was stopped with for a moment when an exiting process still holds the listening socket."""
    deadline = time.monotonic() + timeout
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def require_port(host: str, port: int, what: str, setting: str) -> None:
    if not port_free(host, port):
        raise PortInUse(f"{what}: port {host}:{port} is already in use; stop what holds it or change {setting}")


@dataclass
class ProcInfo:
    name: str
    pid: int
    cmd: list[str]
    log: str
    url: str = ""
    started: float = 0.0


def spawn(
    name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.Popen, ProcInfo]:
    """Start cmd in its own session (so its whole process group can be stopped), output to log_path.

    Children get settings only through `env` (TIDAL_CONFIG): inherited TIDAL_* variables are dropped so a
    child never sees settings other than its parent resolved.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**base, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
    return proc, ProcInfo(name, proc.pid, cmd, str(log_path), started=time.time())


def alive(pid: int) -> bool:
    try:
        return not gone(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def gone(p: psutil.Process) -> bool:
    """Exited; a zombie counts as exited (its parent reaps it, nothing of it runs)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of group pgid (children re-parented after their leader died included)."""
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and not gone(p):
                members.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return members


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    left = [p for p in procs if not gone(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not gone(p)]
    return left


def stop_group(pid: int, timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group pid leads (we start everything with its own session) and any
    children that left it; escalate to SIGKILL after timeout. Works after the leader died."""
    procs = {p.pid: p for p in group_members(pid)}
    try:
        leader = psutil.Process(pid)
        procs.update({p.pid: p for p in [leader, *leader.children(recursive=True)]})
    except psutil.NoSuchProcess:
        pass
    if not procs:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs.values():
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    for p in _wait_gone(list(procs.values()), timeout):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(list(procs.values()), 5.0)


def wait_http(
    url: str,
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    log: str = "",
    accept: Callable[[httpx.Response], bool] | None = None,
) -> None:
    """Poll url until it answers 2xx (and `accept` agrees it is the server we started); fail early if proc exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NotReady(f"{what} exited with code {proc.returncode} before it was ready; see {log}{tail(log)}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.is_success and (accept is None or accept(r)):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise NotReady(f"{what} not ready at {url} after {timeout:.0f} s; see {log}{tail(log)}")


def tail(log: str, lines: int = 15) -> str:
    try:
        text = Path(log).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n  last lines:\n    " + "\n    ".join(text) if text else ""


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def read_procinfo(path: Path) -> ProcInfo | None:
    try:
        return ProcInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_procinfo(path: Path, info: ProcInfo) -> None:
    write_json(path, asdict(info))
