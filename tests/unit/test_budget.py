"""The suite's time budget (tests/budget.py): an overrunning test is stopped at the budget, not at its own
timeout, the run fails and stops there, and the slowest-tests report still comes out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import time
import pytest

@pytest.mark.timeout(900)
def test_overruns():
    time.sleep({sleep})

def test_after():
    pass
"""


def run_suite(tmp_path: Path, sleep: float, budget: float) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE.format(sleep=sleep))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.budget",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            "-o",
            f"session_timeout={budget}",
            "--durations=30",
            "-v",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def test_an_overrun_fails_at_the_budget_with_the_slowest_tests_report(tmp_path):
    run = run_suite(tmp_path, sleep=600, budget=3)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "test_suite.py::test_overruns FAILED" in out, out
    cut = float(re.search(r"Timeout \(>([0-9.]+)s\)", out).group(1))
    assert cut <= 3.0, out  # stopped at what the 3-second budget had left, not at the test's own 900 s
    assert "test_suite.py::test_after" not in out, out  # the run stopped there
    assert "session-timeout: 3.0 sec exceeded" in out and "slowest 30 durations" in out, out


def test_a_run_inside_the_budget_is_untouched(tmp_path):
    run = run_suite(tmp_path, sleep=0.2, budget=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "2 passed" in out, out
