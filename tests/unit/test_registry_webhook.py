"""The registry webhook's signature and replay checks, against MLflow's own signer; its settings."""

from __future__ import annotations

import json

import pytest

from release.registry_webhook import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Delivery,
    WebhookRefused,
    decision_key,
    sign,
    verify,
)
from release.webhook_settings import RegistryWebhookSettings

SECRET = "webhook-secret-0123456789"
NOW = 1_800_000_000.0


def mlflow_signed(body: str, delivery_id: str = "d-1", stamp: float = NOW, secret: str = SECRET) -> dict:
    """The headers MLflow's delivery code sends (mlflow.webhooks.delivery)."""
    from mlflow.webhooks.delivery import _generate_hmac_signature

    ts = str(int(stamp))
    return {
        DELIVERY_HEADER: delivery_id,
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: _generate_hmac_signature(secret, delivery_id, ts, body),
    }


BODY = json.dumps(
    {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": "2027-01-15T08:00:00+00:00",
        "data": {"name": "tab", "alias": "candidate", "version": "3"},
    }
)


def test_a_delivery_signed_by_mlflow_is_accepted_and_read():
    headers = mlflow_signed(BODY)
    assert sign(SECRET, "d-1", headers[TIMESTAMP_HEADER], BODY.encode()) == headers[SIGNATURE_HEADER]
    assert verify(SECRET, headers, BODY.encode(), NOW + 5, 300.0) == ("d-1", NOW)
    delivery = Delivery.model_validate_json(BODY)
    assert delivery.event == "model_version_alias.created" and delivery.data["version"] == "3"


@pytest.mark.parametrize(
    "change, status, words",
    [
        (lambda h, b: ({**h, SIGNATURE_HEADER: h[SIGNATURE_HEADER][:-4] + "AAA="}, b), 401, "signature does not match"),
        (lambda h, b: (h, b.replace(b'"3"', b'"4"')), 401, "signature does not match"),  # the body was altered
        (lambda h, b: ({**h, DELIVERY_HEADER: "d-2"}, b), 401, "signature does not match"),  # replayed under another id
        (lambda h, b: ({k: v for k, v in h.items() if k != SIGNATURE_HEADER}, b), 401, "missing X-MLflow-Signature"),
        (lambda h, b: ({}, b), 401, "X-MLflow-Delivery-Id, X-MLflow-Timestamp, X-MLflow-Signature"),
    ],
)
def test_a_forged_altered_or_unsigned_delivery_is_refused(change, status, words):
    headers, body = change(mlflow_signed(BODY), BODY.encode())
    with pytest.raises(WebhookRefused, match=words) as e:
        verify(SECRET, headers, body, NOW, 300.0)
    assert e.value.status == status


def test_a_delivery_signed_with_another_secret_names_the_setting():
    with pytest.raises(WebhookRefused, match="registry_webhook.secret"):
        verify(SECRET, mlflow_signed(BODY, secret="another-secret-0123456789"), BODY.encode(), NOW, 300.0)


def test_an_old_delivery_is_refused_as_a_replay_and_a_little_clock_skew_is_not():
    with pytest.raises(WebhookRefused, match="stamped 301 s ago; accepted: up to 300 s"):
        verify(SECRET, mlflow_signed(BODY, stamp=NOW - 301), BODY.encode(), NOW, 300.0)
    assert verify(SECRET, mlflow_signed(BODY, stamp=NOW + 30), BODY.encode(), NOW, 300.0)[1] == NOW + 30
    with pytest.raises(WebhookRefused, match="ago"):
        verify(SECRET, mlflow_signed(BODY, stamp=NOW + 120), BODY.encode(), NOW, 300.0)


def test_settings_default_to_a_local_endpoint_and_a_delivery_id_cannot_escape_its_folder():
    cfg = RegistryWebhookSettings(port=5123)
    assert cfg.endpoint == "http://127.0.0.1:5123/mlflow-webhook"
    assert RegistryWebhookSettings(url="https://hooks.example/tidal").endpoint == "https://hooks.example/tidal"
    assert decision_key("tab", "../../etc/passwd") == "state/registry-webhook/model=tab/etcpasswd.json"


def test_the_chart_runs_the_receiver_behind_the_service_its_settings_name():
    """Structural (no `helm` here): the template runs the module, and the chart's settings point MLflow at its Service."""
    from pathlib import Path
    from urllib.parse import urlparse

    import yaml

    chart = Path(__file__).resolve().parents[2] / "infra" / "helm" / "tidal"
    template = (chart / "templates" / "registry-webhook.yaml").read_text()
    values = yaml.safe_load((chart / "values.yaml").read_text())
    cfg = RegistryWebhookSettings.model_validate(values["settings"]["registry_webhook"])
    assert '["python", "-m", "release.webhook_app"]' in template and "name: tidal-registry-webhook" in template
    assert "key: registry-webhook-secret" in template and "TIDAL_REGISTRY_WEBHOOK__SECRET" in template
    url = urlparse(cfg.endpoint)
    assert (url.hostname, url.port, url.path) == ("tidal-registry-webhook", cfg.port, "/mlflow-webhook")
    assert values["registryWebhook"]["enabled"] is False  # opt-in: it needs the MLflow server's webhook settings
