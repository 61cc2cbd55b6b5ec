"""run.sh's set-up logic (what both README commands run first), with a stub interpreter in place of Python:
each environment is built once per requirements digest, a second run installs nothing, a bad engine flavor
is refused with its message, and pytest's "no tests collected" exit is said plainly and fails the run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Logs every call; `-m venv DIR` makes DIR/bin/python (this stub again); `-m pytest` exits with $STUB_PYTEST_RC.
STUB = """#!/usr/bin/env bash
echo "$0 $*" >> "$STUB_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then exit "${STUB_PYTEST_RC:-0}"; fi
exit 0
"""


@pytest.fixture()
def checkout(tmp_path) -> Path:
    """A copy of what run.sh reads: itself, the requirement files and pyproject.toml."""
    root = tmp_path / "checkout"
    (root / "requirements").mkdir(parents=True)
    for name in ("run.sh", "pyproject.toml"):
        shutil.copy2(ROOT / name, root / name)
    for req in (ROOT / "requirements").glob("*.txt"):
        shutil.copy2(req, root / "requirements" / req.name)
    stub = tmp_path / "python-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return root


def run_sh(root: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = root.parent / "calls.log"
    log.write_text("")
    full = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    full.update(
        {
            "TIDAL_CACHE_DIR": str(root.parent / "cache"),
            "TIDAL_BASE_PYTHON": str(root.parent / "python-stub"),
            "TIDAL_ENGINE_FLAVOR": "cpu",
            "STUB_LOG": str(log),
            **env,
        }
    )
    run = subprocess.run(["bash", str(root / "run.sh"), *args], capture_output=True, text=True, env=full, timeout=120)
    return run, log.read_text().splitlines()


def installs(calls: list[str]) -> list[str]:
    return [c for c in calls if " -m pip install" in c]


def test_environments_are_built_once_per_requirements_digest(checkout):
    first, calls = run_sh(checkout, "test", "-q")
    assert first.returncode == 0, first.stderr
    assert sum(" -m venv " in c for c in calls) == 2  # platform and engine
    reqs = [c for c in installs(calls) if " -r " in c]
    assert sorted(c.split(" -r ")[1].split()[0].rsplit("/", 1)[1] for c in reqs) == ["engine-cpu.txt", "platform.txt"]
    assert any(" -e " in c for c in installs(calls))  # the project itself, editable
    assert calls[-1].endswith("-m pytest -q")  # the arguments reach pytest
    assert (checkout / ".venv").is_symlink() and (checkout / ".engine-venv").is_symlink()

    again, calls = run_sh(checkout, "test")
    assert again.returncode == 0, again.stderr
    assert installs(calls) == [] and not any(" -m venv " in c for c in calls)  # nothing installed the second time

    with open(checkout / "requirements" / "platform.txt", "a") as f:
        f.write("\n# changed\n")
    changed, calls = run_sh(checkout, "setup")
    assert changed.returncode == 0, changed.stderr
    assert [c.split(" -r ")[1].split()[0].rsplit("/", 1)[1] for c in installs(calls) if " -r " in c] == ["platform.txt"]
    assert len(list((checkout.parent / "cache" / "envs").glob("platform-*"))) == 2  # a new digest, a new environment


def test_a_bad_engine_flavor_is_refused_with_its_message(checkout):
    run, calls = run_sh(checkout, "test", TIDAL_ENGINE_FLAVOR="rocm")
    assert run.returncode == 2
    assert "TIDAL_ENGINE_FLAVOR must be 'cpu' or 'cuda', got 'rocm'" in run.stderr
    assert not any("-m pytest" in c for c in calls)


def test_no_tests_collected_fails_the_run_and_says_so(checkout):
    run, _ = run_sh(checkout, "test", STUB_PYTEST_RC="5")
    assert run.returncode == 5 and "pytest collected no tests" in run.stderr
    failed, _ = run_sh(checkout, "test", STUB_PYTEST_RC="1")
    assert failed.returncode == 1 and "collected no tests" not in failed.stderr


def test_an_unknown_command_prints_the_usage(checkout):
    run, _ = run_sh(checkout, "tests")
    assert run.returncode == 2 and "usage: ./run.sh demo|test|setup" in run.stderr
