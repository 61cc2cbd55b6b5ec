"""The registry webhook receiver's settings: a leaf module (pydantic only), so loading the platform's settings does not
import the receiver, and with it the MLflow client."""

from __future__ import annotations

from pydantic import Field

from tidal.section import Section


class RegistryWebhookSettings(Section):
    enabled: bool = Field(
        True,
        description=(
            "Start the receiver with the flows runner (`tidal up`) and register it with MLflow as a webhook on "
            "`model_version_alias.created`. MLflow delivers webhooks from SQL backends only (the local SQLite one is)."
        ),
    )
    host: str = Field("127.0.0.1", description="Address the receiver binds to.")
    port: int = Field(5010, ge=1, le=65535, description="Receiver port.")
    url: str | None = Field(
        None,
        description=(
            "The URL MLflow calls (e.g. http://tidal-registry-webhook:5010/mlflow-webhook, the chart's Service); default "
            "http://host:port/mlflow-webhook. MLflow refuses http:// and private addresses unless its server runs with "
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true (the local one does)."
        ),
    )
    secret: str | None = Field(
        None,
        description="HMAC secret MLflow signs deliveries with; None: generated once into data_dir/secrets/registry_webhook.",
    )
    max_age_s: float = Field(
        300.0,
        gt=0,
        description="A delivery stamped longer ago than this is refused as a replay (MLflow's retries take under a minute).",
    )

    @property
    def endpoint(self) -> str:
        return self.url or f"http://{self.host}:{self.port}/mlflow-webhook"
