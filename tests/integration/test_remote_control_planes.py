"""The CLI against control planes it does not run: the session's real Prefect and MLflow behind a TLS-terminating
proxy that checks an Authorization header (Basic for Prefect, a bearer token for MLflow), configured by full URL
with a path prefix, a credential from a file or the environment, and the proxy's CA. `tidal` starts no server."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from data_contracts.dataset import read_manifest, read_parquet
from sim.audit import wait_stored
from tests.integration.tls_proxy import TlsProxy
from tidal.tokens import admin_token

pytestmark = pytest.mark.slow
PREFECT_PASS, MLFLOW_TOKEN = "tidal:prefect-pass-0123", "mlflow-token-4567"


@pytest.fixture(scope="module")
def proxy(settings, platform, tmp_path_factory):
    p = TlsProxy(
        upstreams={"prefect": f"http://{settings.prefect.host}:{settings.prefect.port}", "mlflow": settings.mlflow.tracking_uri},
        accept={"prefect": "Basic " + base64.b64encode(PREFECT_PASS.encode()).decode(), "mlflow": f"Bearer {MLFLOW_TOKEN}"},
        certs=tmp_path_factory.mktemp("certs"),
    ).start()
    yield p
    p.stop()


def remote_config(settings, proxy: TlsProxy, root: Path, prefect_credential: str = PREFECT_PASS) -> Path:
    """The session's settings file, but its servers are the proxy's URLs and its local state is a new directory."""
    config = yaml.safe_load(Path(os.environ["TIDAL_CONFIG"]).read_text())
    root.mkdir(parents=True, exist_ok=True)
    (root / "prefect-credential").write_text(prefect_credential + "\n")
    config.update(data_dir=str(root / "data"), admin_token=admin_token(settings))
    config["store"] = {**config.get("store", {}), "url": settings.store_url}
    config["prefect"] = {
        **config.get("prefect", {}),
        "url": f"{proxy.url}/prefect/api",
        "credential_file": str(root / "prefect-credential"),
        "ca_file": str(proxy.ca_file),
    }
    config["mlflow"] = {
        **config.get("mlflow", {}),
        "url": f"{proxy.url}/mlflow",
        "credential_kind": "bearer",
        "credential_env": "MLFLOW_PROXY_TOKEN",
        "ca_file": str(proxy.ca_file),
    }
    path = root / "remote.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def events_named(settings, name: str) -> list[dict]:
    body = {"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}
    return httpx.post(f"{settings.prefect.api_url}/events/filter", json=body, timeout=30).json()["events"]


def tidal(config: Path, *args: str, token: str | None = MLFLOW_TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "PREFECT_", "MLFLOW_"))}
    env.update(TIDAL_CONFIG=str(config), **({"MLFLOW_PROXY_TOKEN": token} if token else {}))
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_drives_servers_behind_a_tls_proxy_with_credentials(
    settings, gateway, keys, proxy, checkpoints, registry, tmp_path
):
    config = remote_config(settings, proxy, tmp_path)
    status = tidal(config, "status", "--json")
    assert status.returncode == 0, status.stderr
    services = json.loads(status.stdout)["services"]
    for name in ("prefect", "mlflow"):
        assert services[name]["remote"] and services[name]["healthy"] and services[name]["url"].startswith(proxy.url), services

    # traffic for tabfull, collected through the proxy: Prefect's API and events websocket, MLflow's registry and runs
    sent = []
    for i in range(4):
        r = httpx.post(
            f"{gateway}/v1/completions",
            json={"model": "tabfull", "prompt": f"def f{i}(x):\n    return", "max_tokens": 4, "user": f"remote-{i}"},
            headers={"Authorization": f"Bearer {keys['alice']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        fb = httpx.post(
            f"{gateway}/v1/feedback",
            json={"request_id": rid, "event": "rejected"},
            headers={"Authorization": f"Bearer {keys['alice']}"},
        )
        assert fb.status_code == 200, fb.text
        sent.append(rid)
    wait_stored(checkpoints.store, "feedback", set(sent), model="tabfull")
    time.sleep(settings.collect.upload_grace_s + 1)
    before = dict(proxy.passed)
    run = tidal(config, "collect", "tabfull", "--include-open-hour")
    assert run.returncode == 0, run.stderr[-3000:]
    [ds_id] = re.findall(r"^tabfull (ds-\w+)$", run.stdout, re.M)
    samples = read_parquet(checkpoints.store, read_manifest(checkpoints.store, "tabfull", ds_id).data_key)
    assert set(sent) <= set(samples.column("request_id").to_pylist())
    assert proxy.passed["prefect"] > before.get("prefect", 0) and proxy.passed["mlflow"] > before.get("mlflow", 0)
    exp = registry.client.get_experiment_by_name("tabfull/collect")
    assert registry.client.search_runs([exp.experiment_id], f"tags.`tidal.dataset_id` = '{ds_id}'")
    deadline = time.monotonic() + 60  # the server persists events in batches
    while not any(e["payload"]["dataset_id"] == ds_id for e in events_named(settings, "tidal.dataset.ready")):
        assert time.monotonic() < deadline, "the event did not come through the proxy's websocket"
        time.sleep(1)
    assert not list((tmp_path / "data" / "run").glob("*.json")), "no local server was started"

    # a refused credential and a missing one: one line each, naming the setting, never the credential
    refused = tidal(remote_config(settings, proxy, tmp_path / "wrong", "tidal:not-it"), "collect", "tabfull")
    assert refused.returncode == 1 and "prefect at" in refused.stderr and "refused the credential (HTTP 401)" in refused.stderr
    assert "not-it" not in refused.stderr and proxy.refused["prefect"] >= 1
    missing = tidal(config, "collect", "tabfull", token=None)
    assert missing.returncode == 1 and "mlflow.credential_env: $MLFLOW_PROXY_TOKEN is not set" in missing.stderr
