"""The environment a process needs to reach the platform's servers: Prefect's API and home, MLflow's tracking URI
and retries, telemetry off. Used by `tidal` commands, the flows' runner and the processes `tidal up` starts."""

from __future__ import annotations

import os
import sys

from tidal.core_settings import SettingsRoot

TELEMETRY_OFF = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def prefect_env(settings: SettingsRoot) -> dict[str, str]:
    """Prefect's API URL, home and (for a remote server) credential and CA."""
    home = str(settings.data_path / "prefect")
    return {**TELEMETRY_OFF, "PREFECT_API_URL": settings.prefect.api_url, "PREFECT_HOME": home, **settings.prefect.client_env()}


def mlflow_env(settings: SettingsRoot) -> dict[str, str]:
    """MLflow's tracking URI, retries and (for a remote server) credential and CA."""
    env = {
        "MLFLOW_TRACKING_URI": settings.mlflow.tracking_uri,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(settings.mlflow.request_retries),
    }
    return {**env, **settings.mlflow.client_env()}


def use_platform_env(settings: SettingsRoot) -> None:
    """Point this process's Prefect and MLflow clients at the platform's servers (called at start-up)."""
    os.environ.update(prefect_env(settings))
    os.environ.update(mlflow_env(settings))
    if settings.store.s3_endpoint_url:
        os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", settings.store.s3_endpoint_url)
    if "prefect.context" in sys.modules:
        # Prefect reads its settings once, on import: a process that imported it before this point would run
        # its flows on a throw-away in-process server instead of the platform's.
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
