"""The `tidal` command: argument parsing, `status` with nothing running, and one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import pytest

import serving.client  # noqa: F401  main's error path imports these; load them once here, not inside a test
import tidal.registry  # noqa: F401
from tidal.cli import build_parser, main


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No inherited TIDAL_* settings, cwd in tmp, and os.environ restored (the CLI exports Prefect/MLflow variables)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith("TIDAL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def idle_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """Settings whose data_dir is empty and whose service ports nothing listens on."""
    socks = []
    for _ in range(6):  # held open together so the ports differ
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = dict(zip(("prefect", "mlflow", "fleet", "gateway", "flows", "webhook"), (s.getsockname()[1] for s in socks)))
    for s in socks:
        s.close()
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TIDAL_PREFECT__PORT", str(ports["prefect"]))
    monkeypatch.setenv("TIDAL_MLFLOW__PORT", str(ports["mlflow"]))
    monkeypatch.setenv("TIDAL_FLEET__ADMIN_PORT", str(ports["fleet"]))
    monkeypatch.setenv("TIDAL_GATEWAY__PORT", str(ports["gateway"]))
    monkeypatch.setenv("TIDAL_PREFECT__RUNNER_PORT", str(ports["flows"]))
    monkeypatch.setenv("TIDAL_REGISTRY_WEBHOOK__PORT", str(ports["webhook"]))
    return ports


# ---- parsing --------------------------------------------------------------------------------------


def test_fleet_scale_with_non_integer_replicas_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fleet", "scale", "tab", "x"])
    assert exc.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["fleet"], ["nosuch"], ["fleet", "deploy", "tab"]])
def test_incomplete_or_unknown_commands_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def _parsers(p: argparse.ArgumentParser):
    """`p` and every sub-command's parser below it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_page_renders() -> None:
    # a bare '%' in a help string made `tidal --help` crash inside argparse's formatting
    pages = [sub.format_help() for sub in _parsers(build_parser())]
    assert len(pages) > 10
    assert any("control arm 100% at once" in page for page in pages)


def test_parser_maps_commands_to_handlers() -> None:
    p = build_parser()
    args = p.parse_args(["fleet", "scale", "tab", "3"])
    assert (args.cmd, args.fleet_cmd, args.model, args.replicas) == ("fleet", "scale", "tab", 3)
    assert args.func.__name__ == "cmd_fleet"
    args = p.parse_args(["fleet", "deploy", "tab", "@candidate"])
    assert (args.version, args.func.__name__) == ("@candidate", "cmd_fleet")
    args = p.parse_args(["up", "--no-fleet"])
    assert args.no_fleet is True and args.func.__name__ == "cmd_up"
    args = p.parse_args(["import", "chat", "s3://acme-models/llama/v1", "--champion"])
    assert (args.model, args.source, args.champion, args.func.__name__) == (
        "chat",
        "s3://acme-models/llama/v1",
        True,
        "cmd_import",
    )
    args = p.parse_args(["bootstrap", "tab", "code", "--force"])
    assert (args.models, args.force) == (["tab", "code"], True)
    assert p.parse_args(["status", "--json"]).json is True
    args = p.parse_args(["train", "tab", "--dataset", "ds-1"])
    assert (args.model, args.dataset, args.func.__name__) == ("tab", "ds-1", "cmd_train")
    assert p.parse_args(["train", "tab"]).dataset is None


# ---- status ---------------------------------------------------------------------------------------


def test_status_with_nothing_running_reports_every_service_down(
    idle_platform: dict[str, int], capsys: pytest.CaptureFixture
) -> None:
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert set(lines) == {"prefect", "mlflow", "fleet", "gateway", "flows", "webhook"}
    for name, port in idle_platform.items():
        fields = lines[name].split()
        assert fields[1] == "down"
        assert f":{port}" in lines[name]
        assert "pid=None" in lines[name]


def test_status_json_with_nothing_running(idle_platform: dict[str, int], capsys: pytest.CaptureFixture) -> None:
    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert set(status["services"]) == {"prefect", "mlflow", "fleet", "gateway", "flows", "webhook"} and status["fleet"] is None
    for name, svc in status["services"].items():
        assert svc["running"] is False and svc["healthy"] is False and svc["pid"] is None
        assert svc["url"].endswith(f":{idle_platform[name]}")


def test_status_ignores_a_stale_pid_file(idle_platform: dict[str, int], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=10)
    run = tmp_path / "data" / "run"
    run.mkdir(parents=True)
    (run / "mlflow.json").write_text(json.dumps({"name": "mlflow", "pid": dead.pid, "cmd": [], "log": "x"}))
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["services"]["mlflow"]["running"] is False


def test_down_reads_the_engines_of_the_last_fleet_from_its_replicas_file(
    idle_platform: dict[str, int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`tidal down` stops engines a dead supervisor left behind, found in the FleetState it saved as replicas.json."""
    from serving.fleet_replies import FleetState, ModelStatus, ReplicaStatus
    from tidal.platform import Platform
    from tidal.settings import load_settings

    platform = Platform(load_settings())
    replicas = [
        ReplicaStatus(
            name=f"tab-{i}",
            state="ready",
            url="http://127.0.0.1:9",
            pid=pid,
            base_version=1,
            served={"tab@v1": 1},
            restarts=0,
            last_error="",
        )
        for i, pid in enumerate((4242, None))
    ]
    tab = ModelStatus(
        strategy="reload",
        base_version=1,
        serving_version=1,
        adapters=[],
        surge_versions=[],
        desired_replicas=2,
        replicas=replicas,
    )
    assert platform.replica_pids() == []  # no fleet ran yet
    platform.run_dir.mkdir(parents=True, exist_ok=True)
    (platform.run_dir / "replicas.json").write_text(
        FleetState(engine_flavor="cpu", runtime="local", models={"tab": tab}).model_dump_json()
    )
    assert platform.replica_pids() == [4242]
    (platform.run_dir / "replicas.json").write_text('{"models": {"tab": {"replicas": [{"pid": 4242}]}}}')  # not a FleetState
    with caplog.at_level("WARNING", logger="tidal.platform"):
        assert platform.replica_pids() == []
    assert "may still be running" in caplog.text


# ---- errors ---------------------------------------------------------------------------------------


def test_invalid_setting_returns_1_with_error_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("TIDAL_FLEET__BASE_PORT", "-1")
    assert main(["status"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err_lines = captured.err.strip().splitlines()
    assert err_lines[0].startswith("error: ")
    assert sum(line.startswith("error:") for line in err_lines) == 1
    assert "fleet.base_port" in captured.err and "TIDAL_FLEET__BASE_PORT" in captured.err
    assert "Traceback" not in captured.err


def test_missing_config_file_returns_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("TIDAL_CONFIG", str(tmp_path / "missing.yaml"))
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: TIDAL_CONFIG points to") and err.count("\n") == 1
