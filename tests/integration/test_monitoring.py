"""A real Prometheus (Debian's package) scraping the session's gateway, supervisor and Pushgateway, with Tidal's
rules: every query of the Grafana dashboard returns series, every rule loads and evaluates, every target is up.
It runs after the other platform tests: the training panels show the runs they trained (tests/integration/
test_ppo_train.py), which every trainer of the session pushed to the session's Pushgateway."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tidal.prometheus import RULES

pytestmark = [pytest.mark.slow, pytest.mark.after_platform_tests]

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "monitoring" / "dashboard.json"


def query(prom: str, expr: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def test_every_dashboard_query_returns_series_from_the_platform(settings, platform, gateway, keys, tmp_path):
    pushed = httpx.get(f"{settings.prometheus.pushgateway_url}/metrics", timeout=10).text
    assert "tidal_train_iteration{" in pushed, (
        "no training run of this session pushed to its Pushgateway: this test reads what the platform tests trained; "
        "run it with tests/integration/test_ppo_train.py"
    )
    platform.up_prometheus()
    prom = settings.prometheus.url
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=120) as client:
        for event in ("accepted", "partial", "rejected"):  # a completion and its verdict, of each kind
            r = client.post("/v1/completions", json={"model": "tab", "prompt": "def add(a, b):\n", "max_tokens": 8})
            assert r.status_code == 200, r.text
            body = {"request_id": r.json()["id"], "event": event} | ({"accepted_chars": 1} if event == "partial" else {})
            assert client.post("/v1/feedback", json=body).status_code == 200
    routes = platform.routes_client()
    control = routes.show().routes.get("tab")
    version = control.control.version if control else platform.fleet_client().status().models["tab"].serving_version
    routes.set("tab", [{"name": "control", "version": version, "weight": 1.0}], by="test", reason="a route change to chart")

    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    deadline, missing = time.monotonic() + 90, exprs
    while missing and time.monotonic() < deadline:  # a few scrapes and rule evaluations (1 s apart here)
        time.sleep(2)
        missing = [e for e in exprs if not query(prom, e)]
    assert not missing, f"dashboard queries without series: {missing}"

    targets = httpx.get(f"{prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert {(t["labels"]["job"], t["health"]) for t in targets} == {
        ("tidal-gateway", "up"),
        ("tidal-fleet", "up"),
        ("tidal-training", "up"),
    }
    loaded = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {r["name"]: r["health"] for g in loaded for r in g["rules"]}
    expected = {r.get("alert") or r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert set(rules) == expected and set(rules.values()) == {"ok"}, rules
    accept = [float(s["value"][1]) for s in query(prom, 'tidal:accept_rate:ratio_rate5m{model="tab"}')]
    assert accept and all(0 <= a <= 1 for a in accept if a == a), accept  # NaN: no completions in the window
    low, high = settings.collect.rule_for("tab").bounds()  # the reward the gateway reports is the model's rule's
    reward = [float(s["value"][1]) for s in query(prom, 'tidal:reward_per_verdict:rate5m{model="tab"}')]
    assert reward and all(low <= r <= high for r in reward if r == r), (reward, low, high)

    # the README's picture of the dashboard is drawn by this script, from the same queries
    spec = importlib.util.spec_from_file_location("render_dashboard", DASHBOARD.parent / "render_dashboard.py")
    renderer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(renderer)
    drawn = renderer.render(prom, 5, tmp_path / "dashboard.png", step_s=2)
    assert drawn["panels"] == len(json.loads(DASHBOARD.read_text())["panels"]) and drawn["empty"] == [], drawn
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
