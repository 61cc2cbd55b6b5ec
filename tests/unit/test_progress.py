"""Progress of long commands: a rewritten line on a terminal, one plain line per change elsewhere; the command's
result and errors pass through unchanged."""

from __future__ import annotations

import io
import threading

import pytest

from serving.fleet_replies import FleetStatus, ModelStatus, ReplicaStatus
from tidal.progress import Progress, log_status, replica_summary, with_progress


def test_a_plain_stream_gets_one_line_per_change() -> None:
    out = io.StringIO()
    p = Progress(out, tty=False)
    for t, s in [(2, "tab-0 starting"), (4, "tab-0 starting"), (6, "tab-0 ready")]:
        p.update(t, s)
    p.close()
    assert out.getvalue() == "[2 s] tab-0 starting\n[6 s] tab-0 ready\n"


def test_a_terminal_gets_one_line_rewritten() -> None:
    out = io.StringIO()
    p = Progress(out, tty=True)
    p.update(2, "tab-0 starting [tab@v1]")
    p.update(4, "tab-0 ready")
    p.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.startswith("\r[   2 s] tab-0 starting") and "\r[   4 s] tab-0 ready" in text
    assert len(text.split("\r")[-1].rstrip("\n")) == len("[   2 s] tab-0 starting [tab@v1]")  # the longer line blanked


def test_the_status_is_reported_while_the_call_runs_and_its_result_returned() -> None:
    out, release, asked = io.StringIO(), threading.Event(), []

    def status() -> str:
        asked.append(1)
        if len(asked) == 2:
            raise ConnectionError("busy")
        if len(asked) >= 3:
            release.set()
        return f"look {len(asked)}"

    assert with_progress(lambda: release.wait(10) and 42, status, every_s=0.01, progress=Progress(out, tty=False)) == 42
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("look 1") and lines[1].endswith("(status unavailable: ConnectionError)")


def test_the_calls_error_is_raised_as_it_was() -> None:
    def fail() -> None:
        raise ValueError("fleet supervisor answered 409: tab@v9 is not registered")

    with pytest.raises(ValueError, match="tab@v9"):
        with_progress(fail, lambda: "never", every_s=0.01, progress=Progress(io.StringIO(), tty=False))


def test_replica_summary_names_each_replicas_state_and_versions() -> None:
    replicas = [
        ReplicaStatus(
            name="tab-0",
            state="ready",
            url="u",
            pid=1,
            base_version=1,
            served={"tab@v1": 1, "tab@v7": 7},
            restarts=0,
            last_error="",
        ),
        ReplicaStatus(name="tab-1", state="starting", url="u", pid=2, base_version=1, served={}, restarts=2, last_error=""),
    ]
    group = ModelStatus(
        strategy="lora", base_version=1, serving_version=1, adapters=[7], surge_versions=[], desired_replicas=2, replicas=replicas
    )
    status = FleetStatus(engine_flavor="cpu", runtime="local", models={"tab": group}, ready=True, error=None)
    assert replica_summary(status, "tab") == "tab 2/2: tab-0 ready [tab@v1, tab@v7] · tab-1 starting [] restarts=2"
    assert replica_summary(status, "chat") == "chat: not in the fleet yet"


def test_a_log_status_shows_the_last_matching_line_written_since_it_began(tmp_path) -> None:
    log = tmp_path / "train-tab.log"
    log.write_text("iteration 9/9 (50 s, done): reward=1\n")  # an earlier run's
    status = log_status(log, ("iteration ", "resuming"), "training: preparing the run")
    assert status() == "training: preparing the run"
    with open(log, "a") as f:
        f.write("tab/run-2: loading\niteration 1/20 (4 s, ~76 s left): reward=0.1\niteration 2/20 (8 s, ~72 s left): kl=0\n")
    assert status() == "iteration 2/20 (8 s, ~72 s left): kl=0"
    with open(log, "a") as f:
        f.write("gate passed\n")
    assert status() == "iteration 2/20 (8 s, ~72 s left): kl=0"  # the last iteration line stays


def test_the_trainers_eta_is_the_mean_of_the_iterations_this_process_ran() -> None:
    from training.progress import eta, timing

    assert timing((0, 100.0), 1, 10, now=120.0) == (20.0, 80.0)  # 2 iterations in 20 s, 8 to go
    assert eta(*timing((0, 100.0), 1, 10, now=120.0)) == "20 s, ~80 s left"
    assert eta(*timing((5, 100.0), 6, 10, now=120.0)) == "20 s, ~30 s left"  # resumed after 5: 2 ran here, 3 to go
    assert eta(*timing((0, 100.0), 9, 10, now=190.0)) == "90 s, done"
