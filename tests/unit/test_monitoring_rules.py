"""infra/monitoring: the alert and recording rules are valid Prometheus rules, and each alert is unit-tested
(fires on the series that should fire it, stays quiet on a near miss) by promtool itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "infra" / "monitoring"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: `./run.sh setup` installs Debian's prometheus package (Prometheus and promtool)"
    return path


def test_the_rules_are_valid() -> None:
    out = subprocess.run([promtool(), "check", "rules", "rules.yml"], cwd=MONITORING, capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_the_rules_pass_their_unit_tests() -> None:
    out = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=MONITORING, capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_is_tested_firing() -> None:
    rules = yaml.safe_load((MONITORING / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((MONITORING / "rules_test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c["exp_alerts"]}
    assert alerts and fired == alerts, f"alerts without a firing test: {sorted(alerts - fired)}"
