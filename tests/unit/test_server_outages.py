"""An MLflow or Prefect outage is an error naming the server and the fix, never an empty answer or a bare socket error."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from tidal.platform import ServerUnavailable, prefect_reachable
from tidal.registry import Registry, RegistryUnavailable
from tidal.settings import TidalSettings


@pytest.fixture
def dead_uri(monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("call", ["versions", "aliases", "by_alias", "get", "next_version"])
def test_lookups_during_an_outage_fail_loudly(dead_uri, call):
    registry = Registry(dead_uri)
    args = {
        "versions": ("tab",),
        "aliases": ("tab",),
        "by_alias": ("tab", "champion"),
        "get": ("tab", 1),
        "next_version": ("tab",),
    }[call]
    with pytest.raises(RegistryUnavailable) as e:
        getattr(registry, call)(*args)
    assert dead_uri in str(e.value) and "connection refused" in str(e.value) and "tidal up" in str(e.value)


def test_the_raw_client_is_guarded_too(dead_uri):
    with pytest.raises(RegistryUnavailable):
        Registry(dead_uri).client.get_run("0" * 32)


def _connect_error(url: str) -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("GET", url))


def test_a_lost_prefect_server_is_named_with_the_fix(tmp_path):
    settings = TidalSettings(data_dir=tmp_path)
    api = settings.prefect.api_url
    reset = httpx.ReadError("[Errno 104] Connection reset by peer", request=httpx.Request("POST", api + "/flow_runs/"))
    for error in (_connect_error(api + "/flow_runs/"), reset, RuntimeError(f"Failed to reach API at {api}/")):
        with pytest.raises(ServerUnavailable) as e, prefect_reachable(settings):
            raise error
        assert api in str(e.value) and "tidal up" in str(e.value)


def test_other_failures_pass_through_unchanged(tmp_path):
    settings = TidalSettings(data_dir=tmp_path)
    for error in (
        _connect_error("http://127.0.0.1:9/v1/fleet"),
        RuntimeError("something else"),
        httpx.ConnectError("no request attached"),
    ):
        with pytest.raises(type(error)) as e, prefect_reachable(settings):
            raise error
        assert e.value is error


def test_platform_env_reaches_a_prefect_imported_before_it(tmp_path):
    """Prefect reads its settings on import; flows of a process that imported it first must still use the
    platform's server, not a throw-away in-process one."""
    import prefect.context
    from prefect.settings import get_current_settings

    from tidal.client_env import use_platform_env

    saved = dict(os.environ)
    for key in ("PREFECT_API_URL", "PREFECT_HOME"):
        os.environ.pop(key, None)
    prefect.context.refresh_global_settings_context()
    settings = TidalSettings(data_dir=tmp_path, prefect={"port": 4999})
    try:
        assert get_current_settings().api.url != settings.prefect.api_url
        use_platform_env(settings)
        assert get_current_settings().api.url == settings.prefect.api_url
    finally:
        os.environ.clear()
        os.environ.update(saved)
        prefect.context.refresh_global_settings_context()
