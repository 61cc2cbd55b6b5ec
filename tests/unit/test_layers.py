"""The layering the processes rely on: the serving processes (supervisor, gateway) start without the trainer's
libraries, so a fleet that only reads probe files and checkpoints' metadata does not carry torch. And the code's
own rules, run as the README's test command runs everything: the import contracts, ruff's lint and format, deptry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "peft")


def imported_in_fresh_process(modules: str) -> list[str]:
    code = f"import sys, {modules}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip())  # noqa: S307  a list of names printed by the line above


def test_the_serving_processes_start_without_torch_or_transformers():
    # The supervisor reads probe.json (data_contracts/probe.py) and replays it over HTTP; computing a probe is the
    # trainer's (training/probe.py). Before the probe file was a contract of its own, the supervisor loaded torch
    # and transformers to read it (~500 MiB resident at start instead of ~180).
    assert (
        imported_in_fresh_process(
            "serving.supervisor, serving.gateway_app, serving.fleet, serving.replica, "
            "serving.runtime.kubernetes, serving.kube_settings"
        )
        == []
    )


def test_the_release_plane_starts_without_torch_or_transformers():
    assert (
        imported_in_fresh_process("release.operations, release.policy, release.outcomes, release.report, release.live_state")
        == []
    )


def run_tool(*cmd: str) -> subprocess.CompletedProcess:
    """A console script of this environment, run at the repository root (where pyproject.toml configures it)."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=300, cwd=root
    )


def test_the_import_contracts_hold():
    # pyproject.toml [tool.importlinter]: the layers of the README's "How the code is laid out"
    out = run_tool("lint-imports", "--no-cache")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_ruff_finds_nothing():
    out = run_tool("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_code_is_as_ruff_formats_it():
    out = run_tool("ruff", "format", "--check", "--no-cache", ".")
    assert out.returncode == 0, "run `.venv/bin/ruff format .`: " + out.stdout[-4000:] + out.stderr[-2000:]


def test_the_declared_dependencies_are_the_imported_ones():
    # deptry: every package the code imports is declared in pyproject.toml (not only pulled in by another), and
    # every declared one is used
    out = run_tool("deptry", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
