"""Process plumbing: port checks, spawning, stopping process groups, readiness waits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.procs import (
    NotReady,
    PortInUse,
    ProcInfo,
    alive,
    free_port,
    port_free,
    read_procinfo,
    require_port,
    save_procinfo,
    spawn,
    stop_group,
    tail,
    wait_http,
)


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not met within {timeout} s")
        time.sleep(0.02)


@pytest.fixture
def started():
    """Popen objects a test starts; whatever is still alive at the end is killed and reaped."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=5)
        except (subprocess.TimeoutExpired, ChildProcessError):
            pass


# ---- ports ----------------------------------------------------------------------------------------


def test_port_free_false_while_listening_and_true_after() -> None:
    s = _listening_socket()
    port = s.getsockname()[1]
    try:
        assert port_free("127.0.0.1", port) is False
    finally:
        s.close()
    assert port_free("127.0.0.1", port) is True


def test_port_in_use_on_all_interfaces_is_seen_on_loopback() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    try:
        assert port_free("127.0.0.1", s.getsockname()[1]) is False
    finally:
        s.close()


def test_require_port_raises_naming_the_setting() -> None:
    s = _listening_socket()
    port = s.getsockname()[1]
    try:
        with pytest.raises(PortInUse) as exc:
            require_port("127.0.0.1", port, "mlflow", "mlflow.port")
        msg = str(exc.value)
        assert "mlflow.port" in msg and f"127.0.0.1:{port}" in msg and msg.startswith("mlflow:")
    finally:
        s.close()
    require_port("127.0.0.1", port, "mlflow", "mlflow.port")  # free again: no error


# ---- spawn ----------------------------------------------------------------------------------------


def test_spawn_drops_inherited_tidal_vars_but_passes_given_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, started) -> None:
    monkeypatch.setenv("TIDAL_FLEET__BASE_PORT", "9999")
    monkeypatch.setenv("TIDAL_SECRET", "leak")
    monkeypatch.setenv("UNRELATED_VAR", "kept")
    code = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(('TIDAL_', 'UNRELATED_', 'GIVEN_'))}))"
    log = tmp_path / "logs" / "child.log"
    proc, info = spawn("child", [sys.executable, "-c", code], log, env={"TIDAL_CONFIG": "/cfg.yaml", "GIVEN_VAR": "1"})
    started.append(proc)
    assert proc.wait(timeout=10) == 0
    import json

    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen == {"TIDAL_CONFIG": "/cfg.yaml", "GIVEN_VAR": "1", "UNRELATED_VAR": "kept"}
    assert isinstance(info, ProcInfo)
    assert (info.name, info.pid, info.log) == ("child", proc.pid, str(log))
    assert info.started > 0


def test_spawn_runs_in_its_own_session_and_cwd(tmp_path: Path, started) -> None:
    code = "import os; print(os.getsid(0), os.getpgid(0), os.getcwd())"
    log = tmp_path / "out.log"
    proc, _ = spawn("s", [sys.executable, "-c", code], log, cwd=tmp_path)
    started.append(proc)
    assert proc.wait(timeout=10) == 0
    sid, pgid, cwd = log.read_text().split()
    assert int(sid) == proc.pid and int(pgid) == proc.pid
    assert Path(cwd).resolve() == tmp_path.resolve()
    assert os.getsid(0) != proc.pid


def test_spawn_appends_to_log(tmp_path: Path, started) -> None:
    log = tmp_path / "a.log"
    log.write_text("earlier\n")
    proc, _ = spawn("s", [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], log)
    started.append(proc)
    proc.wait(timeout=10)
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and "out" in lines and "err" in lines


# ---- stop_group -----------------------------------------------------------------------------------

STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "open(sys.argv[1], 'w').write('ready'); time.sleep(60)")
subprocess.Popen([sys.executable, "-c", child, sys.argv[1]])
time.sleep(60)
"""


def test_stop_group_kills_process_and_child_that_ignore_sigterm(tmp_path: Path, started) -> None:
    ready = tmp_path / "child-ready"
    proc, _ = spawn("stubborn", [sys.executable, "-c", STUBBORN, str(ready)], tmp_path / "s.log")
    started.append(proc)
    _wait_for(ready.exists, what="grandchild ready")
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 1
    child_pid = children[0].pid
    time.sleep(0.1)  # both ignore SIGTERM now
    t0 = time.monotonic()
    stop_group(proc.pid, timeout=1)
    elapsed = time.monotonic() - t0
    assert elapsed < 5
    assert elapsed >= 0.9  # SIGTERM was ignored, so it waited before SIGKILL
    assert not alive(proc.pid)
    assert not alive(child_pid)
    assert proc.wait(timeout=5) is not None


ORPHANING = """
import subprocess, sys
child = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "open(sys.argv[1], 'w').write('ready'); time.sleep(60)")
subprocess.Popen([sys.executable, "-c", child, sys.argv[1]])
"""


def test_stop_group_stops_the_group_after_its_leader_died(tmp_path: Path, started) -> None:
    ready = tmp_path / "orphan-ready"
    proc, _ = spawn("leader", [sys.executable, "-c", ORPHANING, str(ready)], tmp_path / "s.log")
    started.append(proc)
    _wait_for(ready.exists, what="orphan ready")
    proc.wait(timeout=10)  # the leader is gone (and reaped); its child still runs in the group
    import psutil

    orphans = [p for p in psutil.process_iter() if p.pid != proc.pid and _pgid(p.pid) == proc.pid]
    assert len(orphans) == 1
    stop_group(proc.pid, timeout=1)
    assert not alive(orphans[0].pid)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_stop_group_stops_a_cooperative_process_quickly(tmp_path: Path, started) -> None:
    proc, _ = spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log")
    started.append(proc)
    t0 = time.monotonic()
    stop_group(proc.pid, timeout=10)
    assert time.monotonic() - t0 < 5
    assert not alive(proc.pid)


def test_stop_group_of_a_gone_pid_is_a_no_op(started) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started.append(proc)
    proc.wait(timeout=10)
    stop_group(proc.pid, timeout=1)  # must not raise
    assert not alive(proc.pid)


# ---- wait_http ------------------------------------------------------------------------------------


def test_wait_http_raises_quickly_when_process_exits_early(tmp_path: Path, started) -> None:
    log = tmp_path / "svc.log"
    code = "import sys; print('booting'); print('fatal: config broken', flush=True); sys.exit(3)"
    proc, info = spawn("svc", [sys.executable, "-c", code], log)
    started.append(proc)
    t0 = time.monotonic()
    with pytest.raises(NotReady) as exc:
        wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=30, what="svc", proc=proc, log=info.log)
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "svc exited with code 3" in msg
    assert str(log) in msg
    assert "fatal: config broken" in msg


def test_wait_http_times_out_with_url_in_message(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/health"
    t0 = time.monotonic()
    with pytest.raises(NotReady) as exc:
        wait_http(url, timeout=0.3, what="mlflow", log=str(tmp_path / "none.log"))
    assert time.monotonic() - t0 < 3
    assert "mlflow not ready at" in str(exc.value) and url in str(exc.value)


def test_tail_returns_last_lines_and_empty_for_missing(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("\n".join(f"line {i}" for i in range(30)) + "\n")
    out = tail(str(log), lines=3)
    assert "line 27" in out and "line 29" in out and "line 26" not in out
    assert tail(str(tmp_path / "missing.log")) == ""


def test_procinfo_round_trip_and_unreadable_file(tmp_path: Path) -> None:
    info = ProcInfo("mlflow", 123, ["a", "b"], "/x.log", url="http://h:1", started=1.5)
    save_procinfo(tmp_path / "run" / "mlflow.json", info)
    assert read_procinfo(tmp_path / "run" / "mlflow.json") == info
    (tmp_path / "bad.json").write_text("{not json")
    assert read_procinfo(tmp_path / "bad.json") is None
    assert read_procinfo(tmp_path / "missing.json") is None


def test_alive_of_own_and_dead_process(started) -> None:
    assert alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started.append(proc)
    proc.wait(timeout=10)
    assert not alive(proc.pid)


def test_stopping_a_service_whose_leader_died_stops_its_group_and_frees_its_port(tmp_path: Path, monkeypatch) -> None:
    """The flows runner's leader gone, a member of its group still holding the runner port: `Platform.stop` stops
    that member and returns once the port binds, so an immediate restart (as `tidal demo` does) gets the port."""
    from tidal.platform import Platform
    from tidal.settings import load_settings

    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(key)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = load_settings(data_dir=str(tmp_path / "data"), prefect={"runner_port": port})
    # The leader forks a child in its group that listens on the port, then exits.
    code = (
        "import os, socket, sys, time\n"
        "if os.fork() == 0:\n"
        "    s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "    open(sys.argv[2], 'w').close(); time.sleep(300)\n"
    )
    ready = tmp_path / "listening"
    proc, info = spawn("flows", [sys.executable, "-c", code, str(port), str(ready)], tmp_path / "flows.log")
    proc.wait(timeout=30)  # the leader exited (and is reaped)
    _wait_for(ready.exists, 30, "the child to listen")
    save_procinfo(settings.run_dir / "flows.json", info)
    assert not alive(info.pid) and not port_free("127.0.0.1", port)

    Platform(settings).stop("flows")
    assert port_free("127.0.0.1", port) and read_procinfo(settings.run_dir / "flows.json") is None
