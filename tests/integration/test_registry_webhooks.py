"""Releases from the MLflow registry on the real platform: the real MLflow server calls the receiver
(release/webhook_app.py) on each alias move, signed with its secret. The champion alias moved by hand to a version
that failed its gate is refused and put back; with a gate override tag it is rolled out (probe on every replica,
then all traffic, aliases consistent); a signed delivery sent twice, as MLflow's retry does, rolls back once; a
forged one is refused. The candidate alias moved by hand starting a whole release is test_promote's operator test."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from mlflow import MlflowClient

from release.registry_webhook import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.integration.release_helpers import tags
from tidal import lineage
from tidal.registry import publish
from tidal.tokens import secret

pytestmark = pytest.mark.slow


def wait_for(what: str, check, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return found


def control(platform) -> int | None:
    table = platform.routes_client().show().get("tab")
    return table.control.version if table else None


def signed_delivery(settings, version: int) -> tuple[bytes, dict]:
    """A champion-alias delivery as MLflow sends it, signed with the receiver's secret."""
    body = json.dumps(
        {
            "entity": "model_version_alias",
            "action": "created",
            "timestamp": "now",
            "data": {"name": "tab", "alias": "champion", "version": str(version)},
        }
    ).encode()
    key = secret(settings.data_path, "registry_webhook", settings.registry_webhook.secret)
    delivery_id, stamp = str(uuid.uuid4()), str(int(time.time()))
    return body, {
        DELIVERY_HEADER: delivery_id,
        TIMESTAMP_HEADER: stamp,
        SIGNATURE_HEADER: sign(key, delivery_id, stamp, body),
        "Content-Type": "application/json",
    }


@pytest.mark.timeout(900)
def test_a_champion_alias_moved_by_hand_is_refused_rolled_out_and_rolled_back(
    settings, platform, registry, checkpoints, neutral_adapter, gateway
):
    platform.up_flows()  # the flows runner and the receiver, which registers itself with MLflow
    mlflow_ui = MlflowClient(settings.mlflow.tracking_uri)  # what the MLflow UI does, as an operator would
    assert control(platform) in (None, 1) and registry.aliases("tab")["champion"] == 1
    failed = {"tidal.origin": "test: webhook", lineage.GATE_PASSED: "false", lineage.GATE_REASON: "test: held out"}
    v = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, failed).version
    try:
        # 1. a version that failed its gate: refused, and the champion alias goes back to what the routes serve
        mlflow_ui.set_registered_model_alias("tab", "champion", str(v))
        refused = json.loads(wait_for("the refusal", lambda: tags(registry, v).get("tidal.release.registry_refused")))
        assert (
            "has not passed the offline gate (test: held out)" in refused["reason"] and lineage.GATE_OVERRIDE in refused["reason"]
        )
        wait_for("the champion alias back on v1", lambda: registry.aliases("tab")["champion"] == 1, 30)
        assert control(platform) in (None, 1)

        # 2. the same move with an override: the probe on every replica, then all traffic
        mlflow_ui.set_model_version_tag("tab", str(v), lineage.GATE_OVERRIDE, "oncall: an A/A adapter, no gate run")
        mlflow_ui.set_registered_model_alias("tab", "champion", str(v))
        rolled = json.loads(wait_for("the rollout", lambda: tags(registry, v).get("tidal.release.rolled_out")))
        t = tags(registry, v)
        assert json.loads(t["tidal.release.gate_override"])["by"] == "oncall: an A/A adapter, no gate run"
        assert json.loads(t["tidal.release.verified"])["probes"] == settings.model("tab").replicas
        assert (rolled["immediate"], rolled["replaced"], rolled["by"]) == (False, 1, "registry")
        assert control(platform) == v and registry.aliases("tab")["champion"] == v and registry.aliases("tab")["previous"] == 1
        assert json.loads(t["tidal.release.registry_rollout"])["flow_run"]

        # 3. back to v1 at once: a signed delivery, delivered twice as MLflow's retry does, starts one rollout
        mlflow_ui.set_model_version_tag("tab", "1", lineage.IMMEDIATE, "oncall")
        body, headers = signed_delivery(settings, 1)
        url = settings.registry_webhook.endpoint
        first, again = (httpx.post(url, content=body, headers=headers, timeout=60) for _ in range(2))
        assert first.status_code == again.status_code == 200, first.text + again.text
        assert first.json() == again.json() and first.json()["action"] == "rollout" and first.json()["immediate"] is True
        wait_for("v1 serving again", lambda: control(platform) == 1 and registry.aliases("tab")["champion"] == 1, 120)
        assert registry.aliases("tab")["previous"] == v
        runs = httpx.post(
            f"{settings.prefect.api_url}/flow_runs/filter", json={"flows": {"name": {"any_": ["rollout"]}}}, timeout=30
        ).json()
        assert sum(r["id"] == first.json()["flow_run"] for r in runs) == 1 and len(runs) == 2, [r["name"] for r in runs]

        # 4. forged, or replayed under another id: refused before anything is read
        forged = httpx.post(url, content=body, headers={**headers, SIGNATURE_HEADER: "v1,AAAA"}, timeout=30)
        replayed = httpx.post(url, content=body, headers={**headers, DELIVERY_HEADER: str(uuid.uuid4())}, timeout=30)
        assert (forged.status_code, replayed.status_code) == (401, 401)
        assert "signature does not match" in forged.json()["error"]
    finally:
        mlflow_ui.delete_model_version_tag("tab", "1", lineage.IMMEDIATE)
        if control(platform) != 1:
            from release.operations import rollback_now

            rollback_now(registry, platform.routes_client(), platform.fleet_client(), "tab", to="1", by="test")
        platform.fleet_client().undeploy("tab", v)
