"""Remote control planes in the settings: full URLs, a credential from the environment or a file, a CA; the
environment each client reads them from; and the errors, which name the setting and never the credential."""

from __future__ import annotations

import pytest

from tidal.client_env import mlflow_env, prefect_env
from tidal.core_settings import MlflowSettings, PrefectSettings
from tidal.section import SettingsError
from tidal.settings import load_settings


def test_local_servers_by_default_and_remote_ones_by_url(tmp_path):
    local = load_settings(data_dir=tmp_path)
    assert local.prefect.api_url == "http://127.0.0.1:4200/api" and local.mlflow.tracking_uri == "http://127.0.0.1:5000"
    assert not local.prefect.remote and "PREFECT_API_AUTH_STRING" not in prefect_env(local)
    remote = load_settings(
        data_dir=tmp_path,
        prefect={"url": "https://ops.example/prefect/api/"},
        mlflow={"url": "https://ops.example/mlflow", "credential_kind": "bearer"},
    )
    assert (
        remote.prefect.api_url == "https://ops.example/prefect/api" and remote.mlflow.tracking_uri == "https://ops.example/mlflow"
    )
    assert remote.mlflow.server_host == "ops.example" and remote.prefect.remote


def test_credentials_reach_each_client_in_its_own_variables(tmp_path, monkeypatch):
    (tmp_path / "cred").write_text("ops:s3cret\n")
    monkeypatch.setenv("MLFLOW_TOKEN_FOR_TEST", "tok-123")
    s = load_settings(
        data_dir=tmp_path,
        prefect={"url": "https://p.example/api", "credential_file": str(tmp_path / "cred"), "ca_file": str(tmp_path / "ca.pem")},
        mlflow={"url": "https://m.example", "credential_kind": "bearer", "credential_env": "MLFLOW_TOKEN_FOR_TEST"},
    )
    env = prefect_env(s)
    assert env["PREFECT_API_URL"] == "https://p.example/api" and env["PREFECT_API_AUTH_STRING"] == "ops:s3cret"
    assert env["PREFECT_API_SSL_CERT_FILE"] == str(tmp_path / "ca.pem")
    assert mlflow_env(s)["MLFLOW_TRACKING_TOKEN"] == "tok-123"
    assert s.prefect.auth_headers("prefect") == {"Authorization": "Basic b3BzOnMzY3JldA=="}
    basic = MlflowSettings(url="https://m.example", credential_file=tmp_path / "cred").client_env()
    assert (basic["MLFLOW_TRACKING_USERNAME"], basic["MLFLOW_TRACKING_PASSWORD"]) == ("ops", "s3cret")


def test_bad_access_settings_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="expected http"):
        PrefectSettings(url="ftp://p.example/api")
    with pytest.raises(ValueError, match="set one"):
        PrefectSettings(url="https://p.example/api", credential_env="A", credential_file=tmp_path / "f")
    with pytest.raises(ValueError, match="set its url"):
        MlflowSettings(credential_env="A")
    monkeypatch.delenv("NOT_SET_FOR_TEST", raising=False)
    with pytest.raises(SettingsError, match=r"mlflow.credential_env: \$NOT_SET_FOR_TEST is not set"):
        MlflowSettings(url="https://m.example", credential_env="NOT_SET_FOR_TEST").client_env()
    with pytest.raises(SettingsError, match="prefect.credential_file .*: No such file"):
        PrefectSettings(url="https://p.example/api", credential_file=tmp_path / "missing").client_env()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        PrefectSettings(url="https://p.example/api", credential_file=tmp_path / "empty").client_env()
