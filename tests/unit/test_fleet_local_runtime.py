"""The local runtime's own part (ports, a dead engine, stopping) with stand-in processes: no engine is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.replica import Replica
from serving.runtime import runtime_for
from serving.runtime.local import LocalRuntime
from tidal.registry import VersionInfo
from tidal.settings import load_settings

V1 = VersionInfo("tab", 1, "full", 1, "tidal://store/checkpoints/model=tab/version=1")


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LocalRuntime:
    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return runtime_for(load_settings(fleet={"base_port": 18700, "port_range": 3}))


def replica(runtime: LocalRuntime, cmd: list[str]) -> Replica:
    host, port = runtime.address()
    r = Replica("tab", 0, port, host, V1)
    r.proc = subprocess.Popen(cmd, start_new_session=True)  # as spawn() starts engines: their own process group
    return r


def test_replicas_get_distinct_ports_in_the_range_and_give_them_back(runtime):
    assert isinstance(runtime, LocalRuntime) and runtime.name == "local"
    taken = [runtime.address() for _ in range(3)]
    assert sorted(p for _, p in taken) == [18700, 18701, 18702] and {h for h, _ in taken} == {"127.0.0.1"}
    with pytest.raises(Exception, match="no free replica port in \\[18700, 18703\\)"):
        runtime.address()
    runtime.stop(Replica("tab", 1, 18701, "127.0.0.1", V1))  # no process: only its port comes back
    assert runtime.address() == ("127.0.0.1", 18701)


def test_an_exited_engine_is_lost_with_its_exit_code_and_a_live_one_is_stopped(runtime):
    dead = replica(runtime, [sys.executable, "-c", "raise SystemExit(3)"])
    dead.proc.wait(timeout=30)
    assert runtime.lost(dead) == "engine exited with code 3"
    live = replica(runtime, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert runtime.lost(live) is None
    runtime.discard(live)  # a restart keeps the port
    assert live.proc.poll() is not None and runtime.lost(live).startswith("engine exited")
    runtime.stop(live)
    runtime.stop(dead)
    assert {p for _, p in (runtime.address(), runtime.address())} == {dead.port, live.port}
